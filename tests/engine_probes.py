"""What the model and daemon tests read off a loaded model, the same way in every module: the logits
of fixed prompts (to compare two loads bit for bit), the greedy continuation a daemon must match,
this process's mappings of a file (/proc/self/maps, the kernel's view), and an engine opened with
a prepared-weights cache in a child process (two processes sharing one cache)."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap

import numpy as np

from ktd import _native
from ktd.server.engine import Engine
from paths import TESTS

# The prompt of model_logits: a prefill of these, then two decode steps.
MODEL_TOKENS = np.array([1, 5, 9, 3, 7, 2, 11, 4], np.int32)
# The prompt of engine_logits (one prefill).
ENGINE_TOKENS = np.array([1, 5, 9, 3, 7, 2], np.int32)


def model_logits(model: _native.Model) -> np.ndarray:
    """A prefill of MODEL_TOKENS, then two decode steps, in a fresh context: every logit row."""
    ctx = _native.Context(model, 32, 1, 32)
    n = len(MODEL_TOKENS)
    out = [ctx.forward(MODEL_TOKENS, np.arange(n), np.zeros(n), np.ones(n, bool))]
    for i, t in enumerate((6, 8)):
        out.append(ctx.forward(np.array([t]), np.array([n + i]), np.zeros(1), np.ones(1, bool)))
    return np.concatenate(out)


def engine_logits(e: Engine) -> np.ndarray:
    """Every logit row of a prefill of ENGINE_TOKENS in slot 0 (freed afterwards)."""
    ids = ENGINE_TOKENS
    out = e.forward(ids, np.arange(len(ids), dtype=np.int32), np.zeros(len(ids), np.int32), np.ones(len(ids), bool))
    e.free_seq(0)
    return out


def open_cached(path, cache_dir=None, **kw) -> Engine:
    """Engine.open with the prepared-weights cache in cache_dir (None: off), 2 threads, n_ctx 32."""
    return Engine.open(str(path), n_ctx=32, threads=2, pin=False,
                       weights_cache=str(cache_dir) if cache_dir else "off", **kw)


def greedy_ids(engine: Engine, prompt: str, max_tokens: int) -> list[int]:
    """Up to max_tokens greedy token ids after prompt (stopping at end of text), by direct forwards
    in slot 0 (freed afterwards)."""
    tok = engine.tokenizer
    out: list[int] = []
    pos = 0
    batch = tok.encode(prompt, add_special=True)
    for _ in range(max_tokens):
        n = len(batch)
        logits = engine.forward(np.array(batch, np.int32), np.arange(pos, pos + n, dtype=np.int32),
                                np.zeros(n, np.int32), np.eye(1, n, n - 1, dtype=bool)[0])
        pos += n
        nxt = int(np.argmax(logits[-1]))
        if nxt in tok.eos_ids:
            break
        out.append(nxt)
        batch = [nxt]
    engine.free_seq(0)
    return out


def greedy_in_process(engine: Engine, prompt: str, max_tokens: int) -> str:
    """The text of greedy_ids: what a daemon on the same model must stream at temperature 0."""
    return engine.tokenizer.decode(greedy_ids(engine, prompt, max_tokens))


def mapped_inodes(path: str) -> set[int]:
    """The inodes of this process's mappings whose file name is `path` (also a file since replaced
    by a rename: /proc shows the name it had)."""
    with open("/proc/self/maps") as f:
        return {int(line.split()[4]) for line in f if path in line}


def file_ranges(path) -> list[tuple[int, int]]:
    """The address ranges of this process's mappings of `path` (/proc/self/maps, the kernel's view)."""
    ino = os.stat(path).st_ino
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 6 and int(fields[4]) == ino and fields[5] == os.path.realpath(path):
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                out.append((lo, hi))
    return out


# The child of cache_child: opens the model with the cache, writes engine_logits (numpy .npy) to
# stdout and "CACHE <state> | <reason>" to stderr. A fourth argument limits the size of the files
# it writes (RLIMIT_FSIZE, bytes: EFBIG past it, as on a full disk; Python ignores SIGXFSZ).
_CHILD = textwrap.dedent("""
    import resource, sys
    import numpy as np
    sys.path[:0] = [sys.argv[3]]
    if len(sys.argv) > 4:
        resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[4]), resource.RLIM_INFINITY))
    from ktd.server.engine import Engine
    from engine_probes import engine_logits
    e = Engine.open(sys.argv[1], n_ctx=32, threads=1, pin=False, weights_cache=sys.argv[2])
    np.save(sys.stdout.buffer, engine_logits(e))
    sys.stderr.write("CACHE " + e.model.cache["state"] + " | " + e.model.cache["reason"] + "\\n")
""")


def cache_child(path, cache, prefix=(), env: dict[str, str] | None = None,
                max_file_bytes: int | None = None) -> subprocess.Popen:
    """Another process (behind the command prefix, e.g. a setpriv) that opens the model at path with
    the cache directory cache, with env added to its environment and the files it writes limited
    to max_file_bytes; its result: cache_child_result."""
    full_env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
                    **(env or {}))
    limit = [] if max_file_bytes is None else [str(max_file_bytes)]
    return subprocess.Popen([*prefix, sys.executable, "-c", _CHILD, str(path), str(cache), str(TESTS), *limit],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=full_env)


def cache_child_result(p: subprocess.Popen) -> tuple[np.ndarray, str]:
    """The logits and the "CACHE state | reason" line of a cache_child that must succeed."""
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err.decode()[-3000:]
    state = [line for line in err.decode().splitlines() if line.startswith("CACHE ")][-1]
    return np.load(io.BytesIO(out)), state
