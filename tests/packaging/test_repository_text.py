"""The repository reads as a product, not a lab notebook.

Every text file git knows (tracked, or new and not ignored) is scanned for:

- run-log numbering ("session 29", "Session 7"): which run measured something is not a reason;
- references to an external tracker's issue numbers ("issue 19", "(issue 17;"): the tracker is
  not in the repository (an upstream project's bug is cited by its own name and number, e.g.
  "GCC bug 105593", or by URL);
- commit hashes cited as evidence ("commit 00aedd2", "before a19ed52"): a hash says nothing to a
  reader of a clone that was squashed or re-based;
- machine-specific absolute paths (a home or work directory of the machine a run happened on):
  system paths (/etc/ktd, /var/lib/ktd, /opt/ktd, /run/ktd, /usr/...) and ~/.cache/ktd are fine.

A measurement worth keeping goes to a dated report under docs/perf/ with its CPU and command; a
code comment keeps the reason. The Markdown docs' relative links, and every docs/*.md that a file
names, must exist.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

from paths import ROOT

# kind -> pattern. Each is checked against positive and negative examples below.
PATTERNS: dict[str, re.Pattern[str]] = {
    "run-log numbering": re.compile(r"\b[Ss]essions?\s+#?\d+\b"),
    "tracker issue reference": re.compile(r"\b[Ii]ssues?\s+#?\d+\b"),
    "commit hash as evidence": re.compile(
        # "commit 00aedd2", or a bare abbreviated (7-12) or full (40) hash: lower-case hex with at
        # least one letter and one digit, not part of a longer word, number, path or address range.
        r"\b[Cc]ommits?\s+[0-9a-f]{7,40}\b"
        r"|(?<![\w.#/-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])(?:[0-9a-f]{7,12}|[0-9a-f]{40})(?![\w-])"),
    "machine-specific absolute path": re.compile(r"(?<![\w.~$}])/(?:work|root|home|Users)/"),
}

# Files allowed to contain a pattern, with the reason. Only this file: its patterns and examples.
ALLOWED = {
    "tests/packaging/test_repository_text.py": "the check's own patterns and examples",
}

MARKDOWN_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
DOCS_MENTION = re.compile(r"(?<![\w/.-])docs/[\w./-]+\.md\b")


def findings(lines: Iterable[str]) -> Iterator[tuple[int, str, str]]:
    """(line number from 1, kind, matched text) for every pattern match in `lines`."""
    for n, line in enumerate(lines, 1):
        for kind, pattern in PATTERNS.items():
            for m in pattern.finditer(line):
                yield n, kind, m.group(0)


def repository_files() -> list[Path]:
    """The files git knows under ROOT: tracked ones that exist, and new ones not ignored."""
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             check=True, capture_output=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"not a git checkout, or git is missing ({e}): the file list comes from git")
    names = sorted({n for n in out.decode().split("\0") if n})
    return [ROOT / n for n in names if (ROOT / n).is_file() and not (ROOT / n).is_symlink()]


def text_lines(path: Path) -> list[str] | None:
    """The file's lines, or None for a binary file (a NUL byte in it)."""
    data = path.read_bytes()
    if b"\0" in data:
        return None
    return data.decode("utf-8", errors="replace").splitlines()


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading: lower case, punctuation but '-' and '_' dropped,
    spaces as '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(md: Path) -> set[str]:
    out = set()
    in_code = False
    for line in md.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            out.add(github_anchor(line.lstrip("#")))
    return out


def broken_links(md: Path, root: Path) -> Iterator[tuple[int, str]]:
    """(line, target) of every relative link in `md` whose file, or whose #anchor, is missing."""
    in_code = False
    for n, line in enumerate(md.read_text(encoding="utf-8").splitlines(), 1):
        if line.startswith("```"):
            in_code = not in_code
            continue
        if in_code:
            continue
        for m in MARKDOWN_LINK.finditer(line):
            target = m.group(1)
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (md.parent / path).resolve() if path else md
            if root not in dest.parents and dest != root:
                yield n, target
            elif not dest.exists():
                yield n, target
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                yield n, target


# --- the matcher itself: it must find what it is for and leave the rest alone -------------------

POSITIVE = [
    ("threads (18.2-19.0 GB/s at one, 35.2-35.3 at two, session 29), so", "run-log numbering"),
    ("// Session 7: the other 32-element types", "run-log numbering"),
    ("measured in sessions 12 and 31", "run-log numbering"),
    ("Fault scenarios (issue 19): what an unlucky", "tracker issue reference"),
    ("# arm64 without ARM hardware (issue 17; needs root", "tracker issue reference"),
    ("Time to READY (Issue #20's table)", "tracker issue reference"),
    ("against the code before the cache work (commit 00aedd2, cache off)", "commit hash as evidence"),
    ("was this entry's decode before a19ed52:", "commit hash as evidence"),
    ("| before (00aedd2) |", "commit hash as evidence"),
    ("reverted in commit 8525c2fbd", "commit hash as evidence"),
    ("PY=${PY:-/work/main/.venv/bin/python}", "machine-specific absolute path"),
    ("built in place (e.g. /work/baseline)", "machine-specific absolute path"),
    ("exec >/root/selftest.log 2>&1", "machine-specific absolute path"),
    ("see /home/alice/ktd/notes.md", "machine-specific absolute path"),
]

NEGATIVE = [
    "a session-scoped fixture shared by every test of the session",
    "#pragma GCC diagnostic ignored \"-Wuninitialized\"  // (GCC bug 105593, fixed in GCC 13)",
    "an open issue of the tracker",
    "constexpr float kWeightsSumMin = 6.103515625e-5f;",
    "_mm256_set1_ps(0.693359375f), x);",
    "mask = 0x82f63b78;  // CRC-32C, reflected",
    "55d4c0e1e000-7ffd8a5f9000 ---p 00000000 00:00 0  [rollup]",
    "sha256 1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    "the weights cache in ~/.cache/ktd/weights, /var/cache/ktd under systemd",
    "install -m 0640 -g ktd model.gguf /var/lib/ktd-models/model.gguf",
    'cat "$S/root/selftest.log" inside the test root',
    "cd $HOME/work/ktd",
    "an entry named qwen2.5-coder-0.5b-instruct-q4_k_m.3daaf94232831547.ktdw",
    "decade, defaced, effaced: words of hex letters only",
]


@pytest.mark.parametrize("line,kind", POSITIVE)
def test_matcher_finds(line: str, kind: str) -> None:
    assert kind in [k for _, k, _ in findings([line])], f"{kind!r} not found in {line!r}"


@pytest.mark.parametrize("line", NEGATIVE)
def test_matcher_leaves_alone(line: str) -> None:
    assert list(findings([line])) == []


def test_matcher_names_the_line() -> None:
    got = list(findings(["clean", "also clean", "see issue 4"]))
    assert got == [(3, "tracker issue reference", "issue 4")]


def test_link_check_finds_missing_files_and_anchors(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "A.md").write_text("# Title\n\n## Huge pages\n\n```\n[x](NOPE.md)\n```\n")
    (tmp_path / "README.md").write_text(
        "[ok](docs/A.md) [ok](docs/A.md#huge-pages) [web](https://example.org/x.md)\n"
        "[missing](docs/B.md)\n[bad anchor](docs/A.md#numa)\n[outside](../elsewhere.md)\n[self](#title)\n")
    (tmp_path / "docs" / "B.txt").write_text("")
    got = [t for _, t in broken_links(tmp_path / "README.md", tmp_path.resolve())]
    assert got == ["docs/B.md", "docs/A.md#numa", "../elsewhere.md", "#title"]
    assert list(broken_links(tmp_path / "docs" / "A.md", tmp_path.resolve())) == []


def test_github_anchor() -> None:
    assert github_anchor(" The forward: architectures as data") == "the-forward-architectures-as-data"
    assert github_anchor("`make bench` and its options") == "make-bench-and-its-options"
    assert github_anchor("Huge pages, NUMA") == "huge-pages-numa"
    assert github_anchor("From the GGUF file: `model.weights_map`") == "from-the-gguf-file-modelweights_map"
    assert github_anchor("See [the docs](docs/A.md)") == "see-the-docs"


# --- the repository ---------------------------------------------------------------------------


def test_no_notebook_text_in_the_repository() -> None:
    bad = []
    files = repository_files()
    assert any(f.name == "README.md" for f in files), "the file list from git is missing README.md"
    for path in files:
        rel = path.relative_to(ROOT).as_posix()
        if rel in ALLOWED:
            continue
        lines = text_lines(path)
        if lines is None:
            continue
        bad += [f"{rel}:{n}: {kind}: {text!r}" for n, kind, text in findings(lines)]
    assert not bad, "notebook text (docs/perf/ takes dated figures; comments keep the reason):\n" + "\n".join(bad)


def test_markdown_links_resolve() -> None:
    root = ROOT.resolve()
    docs = [p for p in repository_files() if p.suffix == ".md"]
    assert any(p.name == "README.md" for p in docs)
    bad = [f"{p.relative_to(ROOT).as_posix()}:{n}: {t}" for p in docs for n, t in broken_links(p, root)]
    assert not bad, "links to files or headings that do not exist:\n" + "\n".join(bad)


def test_docs_named_in_files_exist() -> None:
    bad = []
    for path in repository_files():
        lines = text_lines(path)
        if lines is None or path.relative_to(ROOT).as_posix() in ALLOWED:
            continue
        for n, line in enumerate(lines, 1):
            bad += [f"{path.relative_to(ROOT).as_posix()}:{n}: {m.group(0)}" for m in DOCS_MENTION.finditer(line)
                    if not (ROOT / m.group(0)).is_file()]
    assert not bad, "files name docs that do not exist:\n" + "\n".join(bad)
