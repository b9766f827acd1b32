"""The PNG beside bench.json: per model, prefill and decode tokens/s of every engine, the median
ratio ktd/peer under each group of bars, and the DRAM ceiling over the decode bars."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")   # files only, no display
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)

from ktd.bench.e2e_suite import ENGINES, PP_TESTS, TG_TEST  # noqa: E402

COLORS = {"ktd": "tab:blue", "ktd-avx2": "tab:cyan", "llama.cpp": "tab:orange", "llama-bench": "tab:green"}


def _group_label(test: str, threads: int, ratios: dict[str, float | None]) -> str:
    label = f"{test}\n{threads} thread{'s' * (threads > 1)}"
    return label + "".join(f"\nktd/{peer} ×{r:.2f}" for peer, r in ratios.items() if r is not None)


def write_png(report: dict, path: Path) -> None:
    models = [m["name"] for m in report["models"]]
    threads = [bw["threads"] for bw in report["read_bandwidth"]]
    rows = {(r["model"], r["threads"], r["test"], r["engine"]): r for r in report["rows"]}
    engines = [e for e in ENGINES if any(r["engine"] == e for r in report["rows"])]
    width = 0.76 / max(len(engines), 1)
    tests = {r["test"] for r in report["rows"]}
    pp_tests = [test for test in PP_TESTS if test in tests]
    ratios = {(r["model"], r["threads"], r["test"]): r.get("ktd_over") or {"llama.cpp": r["ktd_over_llama_cpp"]}
              for r in report["ratios"]}
    ceiling = {(c["model"], c["threads"]): c["ceiling_tokens_per_s"] for c in report["ceiling"]}
    fig, axes = plt.subplots(len(models), 2, figsize=(11, 3.6 * len(models)), squeeze=False,
                             gridspec_kw={"width_ratios": [2, 1]})
    for i, model in enumerate(models):
        panels = [(axes[i][0], [(test, t) for test in pp_tests for t in threads], "prefill"),
                  (axes[i][1], [(TG_TEST, t) for t in threads if TG_TEST in tests], "decode")]
        for ax, groups, kind in panels:
            top = 0.0
            for g, (test, t) in enumerate(groups):
                for j, engine in enumerate(engines):
                    tps = rows.get((model, t, test, engine), {}).get("tokens_per_s")
                    if tps is not None:
                        ax.bar(g + (j - (len(engines) - 1) / 2) * width, tps, width, color=COLORS[engine])
                        top = max(top, tps)
                if kind == "decode" and ceiling.get((model, t)):
                    c = ceiling[(model, t)]
                    ax.hlines(c, g - 0.38, g + 0.38, colors="black", linestyles="dashed")
                    ax.annotate(f"ceiling {c:.1f}", (g, c), xytext=(0, 2), textcoords="offset points",
                                ha="center", fontsize=8)
                    top = max(top, c)
            ax.set_xticks(range(len(groups)),
                          [_group_label(test, t, ratios.get((model, t, test), {})) for test, t in groups])
            ax.set_ylim(0, top * 1.15 if top else 1)
            ax.set_ylabel("tokens/s")
            ax.set_title(f"{model} — {kind}", fontsize=10)
            ax.grid(axis="y", alpha=0.3)
    labels = []
    for engine in engines:
        missing = [r["unavailable"] for r in report["rows"] if r["engine"] == engine and r["tokens_per_s"] is None]
        labels.append(engine + (f" (not available: {missing[0]})" if missing else ""))
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLORS[e]) for e in engines]
    bws = ", ".join(f"{bw['threads']}t {bw['bytes_per_s'] / 1e9:.1f} GB/s" for bw in report["read_bandwidth"]
                    if bw["bytes_per_s"])
    peers = " and ".join(e for e in engines if e != "ktd") or "llama.cpp"
    fig.suptitle(f"ktd vs {peers}, same GGUF and threads (×: median ktd/peer; read bandwidth {bws})",
                 fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.92))
    fig.legend(handles, labels, loc="upper center", ncol=len(engines), fontsize=9, bbox_to_anchor=(0.5, 0.965),
               frameon=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
