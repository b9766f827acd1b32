"""``ktd run MODEL --prompt TEXT``: generate in-process (no daemon) and stream the text to stdout.

MODEL is a GGUF path or a known model name (fetched into the cache if absent). At the end one line
on stderr gives the measured speeds: ``prefill: X tok/s, decode: Y tok/s``.

With model.weights_map: auto (the default) a run that misses the weights cache serves from the
model file and starts no background build (a one-shot run would leave it behind or cut it
short); ``--prepare`` prepares the entry in the foreground instead (as weights_map: arena).
"""

from __future__ import annotations

import sys
import time


def register(sub) -> None:
    p = sub.add_parser("run", help="generate text from a prompt in-process (no daemon)")
    p.add_argument("model", metavar="MODEL", help="GGUF file or known model name (see `ktd fetch --list`)")
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the model's chat template")
    p.add_argument("--max-tokens", type=int, default=256, metavar="N", help="tokens to generate at most (default 256)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 = greedy (default)")
    p.add_argument("--seed", type=int, default=None, metavar="S", help="sampling seed")
    p.add_argument("--threads", type=int, default=0, metavar="N", help="compute threads (0: one per physical core)")
    p.add_argument("--config", metavar="FILE", default=None,
                   help="take the memory placement from a ktd.yaml (model.numa_nodes, smt, hugepages, "
                        "hugepage_size, mlock and the numa section; KTD_* overrides apply); default: built-in "
                        "defaults")
    p.add_argument("--prepare", action="store_true",
                   help="model.weights_map: auto and the weights cache has no entry: prepare the entry now, "
                        "before generating (a slow first run, then every start maps it); without it such a "
                        "run serves from the model file and prepares nothing (no background build)")
    p.set_defaults(func=run)


def chat_prompt_ids(tok, text: str) -> list[int]:
    """Token ids of a rendered chat: special tokens parsed, and the BOS added only when the
    template did not already write it (gemma's does; a second BOS derails the model)."""
    ids = tok.encode(text, add_special=False, parse_special=True)
    if tok.add_bos and tok.bos_id is not None and (not ids or ids[0] != tok.bos_id):
        ids.insert(0, tok.bos_id)
    return ids


def _progress_bar(what: str, fraction: float | None, **detail: object) -> None:
    """The load's progress on a terminal: one line redrawn in place."""
    if fraction is None:
        return
    width = 30
    n = int(max(0.0, min(1.0, fraction)) * width)
    sys.stderr.write(f"\r[{'#' * n}{'.' * (width - n)}] {fraction:4.0%} {what}\x1b[K")
    sys.stderr.flush()


def run(args) -> int:
    import numpy as np

    from ktd.cli import UserError
    from ktd.commands import model_path
    from ktd.server.engine import Engine
    from ktd.text.sampling import Generation, SamplingParams

    if args.max_tokens < 1:
        raise UserError("--max-tokens must be at least 1")
    if args.threads < 0:
        raise UserError("--threads must be >= 0")
    params = SamplingParams(temperature=args.temperature, seed=args.seed)
    try:
        params.validate()
    except ValueError as e:
        raise UserError(str(e)) from None
    from ktd.ops import config as ktd_config
    from ktd.server.engine import placement_options

    try:
        placement = placement_options(ktd_config.load(args.config))
    except ktd_config.ConfigError as e:
        raise UserError(str(e)) from None
    path = model_path(args.model)

    from ktd.text.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(path)
    if args.chat:
        try:
            text = tok.render_chat([{"role": "user", "content": args.prompt}])
        except ValueError as e:
            raise UserError(f"chat template: {e}") from None
        prompt = chat_prompt_ids(tok, text)
    else:
        prompt = tok.encode(args.prompt)
    if not prompt:
        raise UserError("the prompt encodes to no tokens")
    n_ctx = len(prompt) + args.max_tokens
    bar = _progress_bar if sys.stderr.isatty() else None
    if args.prepare and placement["weights_map"] == "auto":
        placement["weights_map"] = "arena"  # a miss prepares (and writes) the entry here
    eng = Engine.open(path, n_ctx=n_ctx, n_seq_max=1, threads=args.threads, progress=bar, tokenizer=tok, **placement)
    if bar:
        sys.stderr.write("\r\x1b[K")
    if eng.model.cache["state"] == "absent":
        # A one-shot run starts no background build (it would outlive or be cut by the run's end).
        from ktd.ops import weights_cache
        weights_cache.log_load(eng.model.cache, building=False)

    gen = Generation(params, prompt=prompt, eos_ids=tok.eos_ids, stop=[], max_tokens=args.max_tokens,
                     decoder=tok.decode_stream())
    n = len(prompt)
    out = sys.stdout
    t0 = time.perf_counter()
    logits = eng.forward(np.array(prompt), np.arange(n), np.zeros(n), np.arange(n) == n - 1)
    t_prefill = time.perf_counter() - t0
    n_decoded = 0
    t1 = time.perf_counter()
    pos = n
    while True:
        token, piece, finish = gen.accept(logits[0])
        if piece:
            out.write(piece)
            out.flush()
        if finish is not None:
            break
        logits = eng.forward(np.array([token]), np.array([pos]), np.zeros(1), np.ones(1, bool))
        pos += 1
        n_decoded += 1
    t_decode = time.perf_counter() - t1
    out.write("\n")
    out.flush()
    decode_rate = n_decoded / t_decode if n_decoded and t_decode > 0 else 0.0
    print(f"prefill: {n / t_prefill:.1f} tok/s, decode: {decode_rate:.1f} tok/s", file=sys.stderr)
    return 0
