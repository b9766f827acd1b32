"""``ktd perplexity MODEL TEXTFILE [--ctx N]``: the perplexity of a model on a text file, by
llama-perplexity's method (``ktd.model.perplexity``), with a progress bar on stderr.

The result goes to stdout: ``PPL = X +/- Y`` (as llama-perplexity's "Final estimate") and the
running PPL after each chunk (``[1]a,[2]b,...``), or one JSON object with ``--json``.
"""

from __future__ import annotations

import json
import sys


def register(sub) -> None:
    p = sub.add_parser("perplexity", help="perplexity of a model on a text file (llama-perplexity's method)")
    p.add_argument("model", metavar="MODEL", help="GGUF file or known model name (see `ktd fetch --list`)")
    p.add_argument("textfile", metavar="TEXTFILE", help="UTF-8 text (e.g. wikitext-2's wiki.test.raw)")
    p.add_argument("--ctx", type=int, default=512, metavar="N",
                   help="tokens per chunk (default 512, as llama-perplexity); the second half of each is scored")
    p.add_argument("--chunks", type=int, default=None, metavar="N", help="evaluate at most N chunks (default: all)")
    p.add_argument("--threads", type=int, default=0, metavar="N", help="compute threads (0: one per physical core)")
    p.add_argument("--batch", type=int, default=512, metavar="N", help="rows computed at once (default 512)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=run)


def _bar(done: int, total: int, ppl: float, seconds: float) -> str:
    width = 30
    fill = round(width * done / total)
    eta = seconds / done * (total - done) if done else 0.0
    return (f"\r[{'=' * fill}{' ' * (width - fill)}] {done}/{total} chunks  PPL {ppl:.4f}  "
            f"{seconds:.0f}s elapsed, ETA {eta:.0f}s ")


def run(args) -> int:
    from ktd.cli import UserError
    from ktd.commands import model_path
    from ktd.server.engine import Engine
    from ktd.model.perplexity import PerplexityError, evaluate

    if args.ctx < 4 or args.ctx > 1 << 22:
        raise UserError(f"--ctx must be in [4, {1 << 22}], got {args.ctx}")
    if args.threads < 0:
        raise UserError("--threads must be >= 0")
    if not 1 <= args.batch <= 65536:
        raise UserError("--batch must be in [1, 65536]")
    try:
        with open(args.textfile, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise UserError(f"{args.textfile}: cannot read: {e.strerror or e}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{args.textfile}: not UTF-8 text (byte {e.start})") from None
    path = model_path(args.model)
    from ktd.text.tokenizer import Tokenizer

    tokens = Tokenizer.from_gguf(path).encode(text, add_special=True, parse_special=False)
    if len(tokens) < 2 * args.ctx:  # before loading the weights
        raise UserError(f"{args.textfile}: {len(tokens)} tokens; at least {2 * args.ctx} are needed for "
                        f"--ctx {args.ctx} (two chunks, as llama-perplexity requires)")
    engine = Engine.open(path, n_ctx=args.ctx, n_seq_max=1, threads=args.threads, n_batch=args.batch)
    show = not args.no_progress and sys.stderr.isatty()

    def progress(done, total, ppl, seconds):
        if show:
            print(_bar(done, total, ppl, seconds), end="", file=sys.stderr, flush=True)

    print(f"ktd: {len(tokens)} tokens, {len(tokens) // args.ctx if args.chunks is None else min(args.chunks, len(tokens) // args.ctx)} "
          f"chunks of {args.ctx}, {engine.model.n_threads} threads", file=sys.stderr)
    try:
        r = evaluate(engine, tokens, args.ctx, n_chunks=args.chunks, progress=progress)
    except PerplexityError as e:
        raise UserError(str(e)) from None
    finally:
        if show:
            print(file=sys.stderr)
    if args.json:
        print(json.dumps({"model": path, "text": args.textfile, "ppl": r.ppl, "ppl_err": r.ppl_err,
                          "n_ctx": r.n_ctx, "n_chunks": r.n_chunks, "n_tokens": r.n_tokens, "n_scored": r.n_scored,
                          "seconds": round(r.seconds, 3), "tokens_per_s": round(r.tokens_per_s, 2),
                          "threads": int(engine.model.n_threads), "chunk_ppl": r.chunk_ppl}))
    else:
        print(",".join(f"[{i + 1}]{p:.4f}" for i, p in enumerate(r.chunk_ppl)))
        print(f"Final estimate: PPL = {r.ppl:.4f} +/- {r.ppl_err:.5f}")
        print(f"ktd: {r.n_scored} tokens scored in {r.seconds:.2f} s ({r.tokens_per_s:.1f} tokens/s evaluated)",
              file=sys.stderr)
    return 0
