"""The host's transparent-huge-page setting, read independently of ktd (which reports it as
_native.thp_setting()): what page kind the arena and placement tests expect."""

from __future__ import annotations

from pathlib import Path

THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str:
    """The bracketed mode of THP_ENABLED ("always", "madvise", "never"); "" without THP."""
    if not THP_ENABLED.exists():
        return ""
    text = THP_ENABLED.read_text()
    return text[text.index("[") + 1 : text.index("]")]
