"""The routing profile: how often each routed expert of a MoE model has been chosen, kept across
restarts. The daemon counts routing in the forward (``Context.expert_counts``); this module adds
those counts to the ones saved by earlier runs and writes the sum to a file under the state
directory — periodically and on shutdown — so the placement of "hot" experts (the CUDA hybrid
backend's ``gpu.experts: hot``) and operators (``ktctl profile``) see the model's real traffic,
not one run's.

One file per model, ``<dir>/routing/<key>.npy`` (a numpy array uint64 [n_layer, n_expert]),
where the key is the SHA-256 of the file's size and its GGUF header (metadata and tensor table):
it names the model, its shapes and its quantization without reading the weights (hashing a
400 GB file at each start would take minutes). A file whose shape does not match, that cannot be
parsed or read, is logged and ignored (the profile starts from zero); so is a file others
control (ktd.ops.file_trust: it and its directory must be this user's or root's and writable by
no one else; no symbolic link is followed), since the counts decide which experts get the GPU.
A write that fails (disk full, read-only state directory, quota) is logged once per kind of error
and the daemon goes on serving. Writes are atomic: a temporary file in the same directory
(created 0750), fsync, rename.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from ktd.ops import file_trust

log = logging.getLogger("ktd.ops.routing_profile")

SAVE_EVERY_S = 300.0   # the daemon's periodic write; also on shutdown
TOP_EXPERTS = 8        # per layer in summary()


def default_dir() -> Path:
    """$STATE_DIRECTORY (systemd's StateDirectory=, /var/lib/ktd) or ~/.local/state/ktd."""
    state = os.environ.get("STATE_DIRECTORY", "").split(":")[0]
    if state:
        return Path(state)
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "ktd"


def model_key(path: str | os.PathLike[str]) -> str:
    """SHA-256 (hex) of the GGUF's size and header bytes (everything before the tensor data)."""
    from ktd.model.gguf import GGUFFile

    f = GGUFFile(str(path))
    h = hashlib.sha256()
    h.update(f"ktd-routing-profile/1 {f.file_size}\n".encode())
    with open(path, "rb") as fh:
        remaining = f.data_offset
        while remaining > 0:
            chunk = fh.read(min(remaining, 1 << 20))
            if not chunk:
                break
            h.update(chunk)
            remaining -= len(chunk)
    return h.hexdigest()


def layer_summaries(counts: np.ndarray | None, top_n: int) -> list[dict[str, Any]]:
    """Per layer that routed any token (counts: [n_layer, n_expert]): ``{"layer", "routed",
    "top": [[expert, count], ...]}``, the ``top_n`` most used experts, most first (ties: lower
    expert first), experts never chosen left out. Shared by ``ktctl profile show`` and ``status``."""
    layers: list[dict[str, Any]] = []
    if counts is None:
        return layers
    for il, row in enumerate(counts):
        total = int(row.sum())
        if total:
            top = np.argsort(-row.astype(np.int64), kind="stable")[:top_n]
            layers.append({"layer": il, "routed": total,
                           "top": [[int(e), int(row[e])] for e in top if row[e]]})
    return layers


class RoutingProfile:
    """The saved counts of one model plus the live counts of this run.

    ``update(live)`` takes the engine's counts since load (monotonic); the profile is
    ``saved + live - live_at_reset``. ``reset()`` starts from zero (saved counts dropped).
    """

    def __init__(self, directory: str | os.PathLike[str] | None, key: str, shape: tuple[int, int]):
        self.path = Path(directory) / "routing" / f"{key}.npy" if directory is not None else None
        self.key = key
        self.shape = shape
        self.saved = np.zeros(shape, np.uint64)
        self.live = np.zeros(shape, np.uint64)
        self.offset = np.zeros(shape, np.uint64)
        self.saved_at: float | None = None
        self.last_error: str | None = None
        self._logged: set[str] = set()
        if self.path is not None:
            self._read()

    def _read(self) -> None:
        assert self.path is not None
        try:
            with os.fdopen(file_trust.open_trusted(self.path), "rb") as fh:
                data = np.load(fh, allow_pickle=False)
        except FileNotFoundError:
            return
        except file_trust.UntrustedFile as e:
            log.warning("routing profile ignored, starting from zero: %s", e)
            return
        except (OSError, ValueError, EOFError) as e:
            log.warning("routing profile %s cannot be read (%s); starting from zero", self.path, e)
            return
        if data.dtype != np.uint64 or data.shape != self.shape:
            log.warning("routing profile %s holds %s %s, this model has %s experts by layer; "
                        "starting from zero", self.path, data.dtype, data.shape, self.shape)
            return
        self.saved = data
        log.info("routing profile: %d routed tokens from earlier runs (%s)", int(data.sum()), self.path)

    def update(self, live: np.ndarray | None) -> None:
        if live is not None and live.shape == self.shape:
            self.live = np.asarray(live, np.uint64)

    def counts(self) -> np.ndarray:
        return self.saved + (self.live - np.minimum(self.offset, self.live))

    def reset(self) -> None:
        self.saved = np.zeros(self.shape, np.uint64)
        self.offset = self.live.copy()

    def save(self) -> bool:
        """Write the profile atomically; False (logged) when it cannot be written."""
        if self.path is None:
            return False
        counts = self.counts()
        tmp = None
        try:
            self.path.parent.mkdir(mode=0o750, parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".routing-", suffix=".npy.tmp", dir=self.path.parent)
            with os.fdopen(fd, "wb") as fh:
                np.save(fh, counts, allow_pickle=False)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.path)
            tmp = None
        except OSError as e:
            kind = e.strerror or type(e).__name__
            self.last_error = f"{self.path}: {kind}"
            if kind not in self._logged:  # once per kind: a full disk must not flood the journal
                self._logged.add(kind)
                log.warning("routing profile not written (%s): %s; serving goes on", self.path, kind)
            return False
        finally:
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
        self.saved_at = time.time()
        self.last_error = None
        return True

    def summary(self) -> dict[str, Any]:
        """What ``ktctl profile show`` prints: per MoE layer the tokens routed and the top experts."""
        counts = self.counts()
        return {"key": self.key, "path": str(self.path) if self.path else None,
                "n_layer": self.shape[0], "n_expert": self.shape[1], "routed": int(counts.sum()),
                "saved_at": self.saved_at, "last_error": self.last_error,
                "layers": layer_summaries(counts, TOP_EXPERTS)}
