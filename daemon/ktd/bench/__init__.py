"""Benchmarks (``make bench-*``): report throughput and ratios, never assert timings."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_results(results: Any, out: Path) -> None:
    """Write ``results`` as indented JSON to ``out`` (its directory created), atomically: a reader
    sees the previous file or the new one, never a half-written one."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=1) + "\n")
    os.replace(tmp, out)
