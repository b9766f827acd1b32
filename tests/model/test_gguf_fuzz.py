"""Property: any byte mutation of a small valid GGUF file either parses (and then every value,
tensor view and the inspect report are usable) or raises GGUFError — never a crash, a hang, another
exception type or a multi-GB allocation.

All mutations run in ONE child process under RLIMIT_AS and a timeout, so a segfault, an abort, a
runaway allocation or a hang is reported as a test failure naming the seed to reproduce, instead
of taking pytest down.
"""

from __future__ import annotations

import resource
import subprocess
import sys
import textwrap

import gguf

from gguf_samples import write_small

N_MUTATIONS = 3000
ADDRESS_SPACE_LIMIT = 2 << 30  # bytes; a length field driving a big allocation hits this
TIMEOUT_S = 600                # generous for a loaded machine; a hang in one parse exceeds it

# argv: source file, scratch file, first seed, number of seeds, end of the header (data offset).
CHILD = textwrap.dedent("""
    import random, struct, sys
    from ktd import GGUFError
    from ktd.model.gguf import GGUFFile
    from ktd.model.inspect import inspect_model, render

    src, scratch, first, count, header_end = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
    orig = open(src, "rb").read()
    INTERESTING = [0, 1, 2, 3, 4, 7, 8, 9, 12, 13, 31, 32, 33, 64, 0x7F, 0x80, 0xFF, 0xFFFF,
                   2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**62, 2**63 - 1, 2**63, 2**64 - 1, len(orig)]

    def mutate(rng):
        b = bytearray(orig)
        for _ in range(rng.randint(1, 4)):
            # Mostly the header (counts, lengths, types, dims, offsets); sometimes anywhere.
            pos = rng.randrange(min(header_end, len(b)) if rng.random() < 0.9 else len(b))
            op = rng.randrange(7)
            if op == 0:
                b[pos] ^= 1 << rng.randrange(8)
            elif op == 1:
                b[pos] = rng.randrange(256)
            elif op == 2:
                b[pos:pos + 4] = struct.pack("<I", rng.choice(INTERESTING) & 0xFFFFFFFF)
            elif op == 3:
                b[pos:pos + 8] = struct.pack("<Q", rng.choice(INTERESTING))
            elif op == 4:
                del b[pos:]
            elif op == 5:
                b[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
            else:
                del b[pos:pos + rng.randint(1, 16)]
            if not b:
                break
        return bytes(b)

    accepted = rejected = 0
    for seed in range(first, first + count):
        data = mutate(random.Random(seed))
        with open(scratch, "wb") as fh:
            fh.write(data)
        print(seed, flush=True)  # the last seed printed is the one that crashed or hung
        try:
            f = GGUFFile(scratch)
        except GGUFError:
            rejected += 1
            continue
        accepted += 1
        for key in f.metadata:
            f.metadata[key], f.metadata_type(key), f.metadata_array_type(key)
        for t in f.tensors.values():
            assert t.offset % f.alignment == 0 and t.offset >= f.data_offset, (seed, t)
            assert t.offset + t.nbytes <= len(data) == f.file_size, (seed, t)
            view = f.tensor_data(t.name)
            assert len(view) == t.nbytes and view[0] == data[t.offset] and view[-1] == data[t.offset + t.nbytes - 1]
        try:
            render(inspect_model(scratch))
        except GGUFError:
            pass
    print(f"done accepted={accepted} rejected={rejected}", flush=True)
""")


def _limit_child() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE_LIMIT, ADDRESS_SPACE_LIMIT))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def test_random_mutations_parse_or_raise_gguf_error(tmp_path):
    src = write_small(tmp_path / "small.gguf")
    header_end = gguf.GGUFReader(src).data_offset
    scratch = tmp_path / "mutated.gguf"
    cmd = [sys.executable, "-c", CHILD, str(src), str(scratch), "0", str(N_MUTATIONS), str(header_end)]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, preexec_fn=_limit_child)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        last = out.split()[-1] if out.split() else "?"
        raise AssertionError(f"mutation loop hung (> {TIMEOUT_S} s) at seed {last}; "
                             f"the mutated file is {scratch}") from None
    lines = r.stdout.split()
    if r.returncode != 0:
        last = lines[-1] if lines else "?"
        how = f"signal {-r.returncode}" if r.returncode < 0 else f"exit status {r.returncode}"
        raise AssertionError(
            f"mutation seed {last} ended the child with {how} (rerun: {' '.join(cmd[:2])} <CHILD> {src} "
            f"{scratch} {last} 1 {header_end}); stderr:\n{r.stderr[-3000:]}")
    summary = r.stdout.strip().splitlines()[-1]
    assert summary.startswith("done"), r.stdout[-500:]
    counts = dict(kv.split("=") for kv in summary.split()[1:])
    # The mutations must exercise both outcomes, or the property says little.
    assert int(counts["accepted"]) > 0 and int(counts["rejected"]) > 0, summary
    assert int(counts["accepted"]) + int(counts["rejected"]) == N_MUTATIONS
