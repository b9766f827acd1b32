"""What the end-to-end benchmark (``ktd.bench.e2e``) runs and its plot (``ktd.bench.e2e_plot``) draws:
the engines it compares, in the report's order, and its tests in llama-bench's names (ppN: a
prompt of N tokens, tgN: N decoded tokens)."""

from __future__ import annotations

ENGINES = ("ktd", "ktd-avx2", "llama.cpp", "llama-bench")
PP_TESTS = {"pp128": 128, "pp512": 512}
TG_TEST, TG_TOKENS = "tg128", 128
TESTS = (*PP_TESTS, TG_TEST)
