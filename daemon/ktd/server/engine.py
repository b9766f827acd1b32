"""The real engine: a native model + KV-cache context + the GGUF tokenizer (``ktd.server.engine_api.Engine``).

``load(config, progress)`` is the daemon's engine factory; ``Engine.open(path, ...)`` is the
lower-level constructor used by ``ktd run``, the tests and the benchmarks.
"""

from __future__ import annotations

import inspect
import logging
import os
import threading
import time
from typing import Any

import numpy as np

from ktd import GGUFError, _native

from ktd.ops import weights_cache
from ktd.ops import config as ktd_config
from ktd.server.engine_api import Progress
from ktd.errors import ContextOverflow
from ktd.ops.routing_profile import layer_summaries
from ktd.text.tokenizer import Tokenizer

log = logging.getLogger("ktd.server.engine")


def _takes_detail(progress: Progress) -> bool:
    """Whether a progress callable takes the keyword details (phase, done_bytes, total_bytes):
    the daemon's does; a plain (what, fraction) callable gets those two only."""
    try:
        params = inspect.signature(progress).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind is inspect.Parameter.VAR_KEYWORD or p.name == "phase" for p in params)


class _ProgressReporter:
    """Reports a native load's progress (phase, bytes) to ``progress`` every PERIOD_S from a
    thread, while the loading thread waits in the native constructor (the GIL released)."""

    PERIOD_S = 0.5

    def __init__(self, loading: "_native.LoadProgress", progress: Progress):
        self._loading, self._progress = loading, progress
        self._detail = _takes_detail(progress)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ktd-load-progress", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        last = None
        while not self._done.wait(self.PERIOD_S):
            p = self._loading
            phase, done, total = p.phase, p.done, p.total
            if phase in ("starting", "done") or not total or (phase, done) == last:
                continue
            last = (phase, done)
            text = f"{phase}: {done / (1 << 30):.2f} of {total / (1 << 30):.2f} GiB"
            if self._detail:
                self._progress(text, done / total, phase=phase, done_bytes=done, total_bytes=total)
            else:
                self._progress(text, done / total)

    def stop(self) -> None:
        self._done.set()
        self._thread.join()


class BackendNotMoved(Exception):
    """Engine.adopt: the load's backend cannot be set on the new context (``kv_emptied``: a
    device backend was released and set again on the old one, its KV cache gone with it)."""

    def __init__(self, message: str, kv_emptied: bool):
        super().__init__(message)
        self.kv_emptied = kv_emptied


class Engine:
    """One loaded model with ``n_seq_max`` KV slots of ``n_ctx`` tokens each."""

    def __init__(self, model: "_native.Model", context: "_native.Context", tokenizer: Tokenizer, path: str,
                 cache_slots: int = 0, model_options: dict[str, Any] | None = None):
        self.model = model
        self.context = context
        self.tokenizer = tokenizer
        self.path = path
        self.n_ctx = context.n_ctx
        self.n_kv_slots = context.n_seq_max
        self.n_seq_max = self.n_kv_slots - cache_slots
        self.kv_bytes_per_token = context.kv_bytes_per_token
        self.n_vocab = model.n_vocab
        # Routing statistics as last copied by the engine thread (info() runs on the event loop
        # and must not wait for the context lock a running forward holds).
        self._expert_snapshot: np.ndarray | None = None
        self._expert_snapshot_at = 0.0
        # The routing counts of contexts replaced by a weights switch (added to the context's own:
        # the counts stay cumulative since load; None: no switch, or reset since).
        self._expert_base: np.ndarray | None = None
        # The GPU decision of the load (ktd.model.gpu; None: opened without one, i.e. CPU only) and the
        # hybrid backend's transfer counters as of the last snapshot (info() must not lock).
        self.gpu: Any = None
        self._hybrid_snapshot: dict[str, int] | None = None
        # The context's backend as set at load (set_backend's arguments; None: the CPU): the
        # weights switch sets it on the new context.
        self.backend_args: tuple[str, dict[str, Any]] | None = None
        self.pool_spin_us: int | None = None  # gpu.pool_spin_us while a hybrid backend is set
        # The native Model keywords of the load (open_model opens the file again with them).
        self.model_options: dict[str, Any] = dict(model_options or {})

    @classmethod
    def open(cls, path: str | os.PathLike, *, n_ctx: int = 4096, n_seq_max: int = 1, threads: int = 0,
             n_batch: int = 512, pin: bool = True, allow_repack: bool = True, cache_slots: int = 0,
             progress: Progress | None = None, tokenizer: Tokenizer | None = None,
             cache_in_background: bool = False, **placement: Any) -> "Engine":
        """Load ``path``. ktd.GGUFError names the tensor/key on a bad or unsupported file.

        ``cache_slots``: KV slots beyond ``n_seq_max`` for the prefix cache (``ktd.server.prefix_cache``).
        ``placement``: the native Model's placement options (nodes, smt, sysfs_root, affinity,
        hugepages, hugetlb_page_size, mlock, numa_experts, numa_dense) and ``weights_cache`` (a
        model.weights_cache value: auto, off or a directory; absent = off); see ``load`` for the
        config keys they come from. ``tokenizer``: the file's, when the caller has already read it.
        ``cache_in_background``: a new cache entry is written by a thread of its own after the
        load (the daemon: it serves meanwhile) rather than before returning.
        model.weights_map: auto and a cache miss (``model.cache["state"]`` is ``absent``): served
        from the file; what follows is the caller's (the daemon's ``ktd.server.weights.WeightsManager``
        has the entry built and switches to it; ``ktd run`` does not)."""
        path = os.fspath(path)
        # The tokenizer first: its metadata is checked in a fraction of a second, before the
        # weights are read.
        if tokenizer is None:
            if progress:
                progress("loading tokenizer", None)
            tokenizer = Tokenizer.from_gguf(path)
        if progress:
            progress("loading weights", None)
        cache_dir, cache_off = weights_cache.prepare_dir(placement.pop("weights_cache", "off"))
        options = {"n_threads": threads, "pin": pin, "allow_repack": allow_repack, "cache_dir": cache_dir, **placement}
        loading = _native.LoadProgress()
        reporter = _ProgressReporter(loading, progress) if progress else None
        try:
            model = _native.Model(path, progress=loading, cache_write_background=cache_in_background, **options)
        except UnicodeDecodeError as e:  # a native message quoting a name from the file
            raise GGUFError(f"{path}: a name or string in the file is not valid UTF-8 ({e.reason})") from None
        finally:
            if reporter:
                reporter.stop()
        if model.n_vocab != tokenizer.n_vocab:  # llama.cpp requires the same (n_vocab = tokens)
            raise GGUFError(f"{path}: tokenizer.ggml.tokens has {tokenizer.n_vocab} entries but "
                            f"token_embd.weight has {model.n_vocab} rows")
        log_memory(model, placement.get("hugepages", "auto"))
        # One snapshot for both: the background write may end between two reads, and then "writing"
        # would be logged with no thread left to log "written".
        cache = model.cache
        if cache["state"] != "absent":  # a miss under auto: logged by the caller, who decides what follows
            weights_cache.log_load(cache, cache_off)
        if cache["state"] == "writing":
            weights_cache.log_when_written(model)
        context = _native.Context(model, n_ctx, n_seq_max + cache_slots, n_batch)
        return cls(model, context, tokenizer, path, cache_slots, options)

    # --- new weights (ktd.server.weights: the switch after a weights_map: auto miss) ------------

    def open_model(self) -> "_native.Model":
        """The model file opened again with the load's options (under weights_map: auto: its cache
        entry mapped if it is there and valid); not swapped in."""
        return _native.Model(self.path, **self.model_options)

    def new_context(self, model: "_native.Model") -> "_native.Context":
        """A context on ``model`` of this engine's shape (n_ctx, KV slots, n_batch), KV cache empty."""
        return _native.Context(model, self.n_ctx, self.n_kv_slots, self.context.n_batch)

    def adopt(self, model: "_native.Model", context: "_native.Context") -> None:
        """Engine thread, no sequence in flight: serve from ``model`` and ``context`` (from
        ``new_context``) from now on, with the load's backend set on the context; the routing
        counts stay cumulative. BackendNotMoved: the backend cannot be set on the new context,
        and the old model keeps serving."""
        name = self.backend_args[0] if self.backend_args else "cpu"
        try:
            self._move_backend(context)
        except Exception as e:
            # A device backend was released and set again: its KV cache went with it.
            raise BackendNotMoved(f"the backend {name} cannot be set on the new weights: {type(e).__name__}: {e}",
                                  kv_emptied=name.startswith("cuda")) from e
        if self.model.n_expert:
            self._expert_base = self.expert_counts()  # the old context's, carried over
        self.model, self.context = model, context
        self._hybrid_snapshot = None
        try:
            self.model.pin_forward_thread()  # as the scheduler did for the first model (one node: nothing)
        except OSError as e:
            log.warning("could not pin the engine thread to the new weights' pool: %s", e)

    def _move_backend(self, context: Any) -> None:
        """Sets the load's backend on ``context``. A device backend holds the device's copy of the
        weights: the old context's is released first, and restored if the new one fails."""
        if self.backend_args is None:
            return
        name, kw = self.backend_args
        if self.pool_spin_us is not None:
            context.pool_spin_us = self.pool_spin_us  # the new weights' pool (a new model's)
        if not name.startswith("cuda"):
            context.set_backend(name, **kw)
            return
        self.context.set_backend("cpu")
        try:
            context.set_backend(name, **kw)
        except Exception:
            try:
                self.context.set_backend(name, **kw)
            except Exception as e:
                log.error("gpu: the backend %s could not be restored on the model file's weights, running on the "
                          "CPU only: %s", name, e)
                self.backend_args = None
                if self.gpu is not None:
                    self.gpu.backend, self.gpu.reason = "cpu", str(e)
            raise

    def info(self) -> dict[str, Any]:
        m = self.model
        return {
            "path": self.path,
            "name": os.path.basename(self.path),
            "architecture": m.arch,
            "n_params": int(m.n_params),
            "n_vocab": int(m.n_vocab),
            "n_layer": int(m.n_layer),
            "n_embd": int(m.n_embd),
            "n_ctx": int(self.n_ctx),
            "n_seq_max": int(self.n_seq_max),
            "prefix_cache_slots": int(self.n_kv_slots - self.n_seq_max),
            "isa": m.isa,
            "threads": int(m.n_threads),
            "repacked_bytes": int(m.repacked_bytes),
            "weights_cache": {k: m.cache[k] for k in ("state", "path", "bytes", "reason")},
            "numa": numa_summary(m.memory),
            "memory": {"hugepages": {"kind": m.memory["page_kind"] or None,
                                     "page_size": int(m.memory["page_size"]),
                                     "reason": m.memory["page_reason"], **arena_huge_pages(m)},
                       **weights_map_summary(m.memory)},
            **({"experts": self._experts_summary()} if m.n_expert else {}),
            **({"gpu": self.gpu.summary(self._hybrid_snapshot)} if self.gpu is not None else {}),
        }

    EXPERT_SNAPSHOT_S = 1.0  # how often forward() refreshes the copy info() summarises
    TOP_EXPERTS = 4

    def expert_counts(self) -> np.ndarray:
        """uint64 [n_layer, n_expert]: tokens routed to each expert since load or the last reset
        (dense layers 0). Engine thread only: it waits for a running forward."""
        counts = self.context.expert_counts()
        return counts if self._expert_base is None else counts + self._expert_base

    def expert_snapshot(self) -> np.ndarray | None:
        """The routing counts as of the last forward's snapshot (any thread; at most
        EXPERT_SNAPSHOT_S old; None before the first forward or on a dense model)."""
        return self._expert_snapshot

    def reset_expert_counts(self) -> None:
        self.context.reset_expert_counts()
        self._expert_base = None
        self._expert_snapshot = None

    def _experts_summary(self) -> dict[str, Any]:
        """Compact routing statistics for ``status``: per MoE layer the tokens routed and the most
        used experts [[expert, count], ...] (from the engine thread's last snapshot)."""
        m = self.model
        return {"n_expert": int(m.n_expert), "n_expert_used": int(m.n_expert_used),
                "layers": layer_summaries(self._expert_snapshot, self.TOP_EXPERTS)}

    # forward(..., greedy=True) is available (the scheduler's fast path for plain greedy rows).
    supports_greedy = True

    def forward(self, tokens: np.ndarray, positions: np.ndarray, seq_ids: np.ndarray,
                want_logits: np.ndarray, greedy: bool | np.ndarray = False) -> Any:
        """float32 [n_marked, n_vocab]; ContextOverflow if a position reaches n_ctx. ``greedy``:
        int32 [n_marked] instead, each marked row's greedy token as the sampler chooses it at
        temperature 0 without penalties or mask, taken natively while the output head writes the
        logits (no logits are returned, so none is copied or read again); a negative value where
        the sampler would reject the row's logits (``_native.sampling.greedy_error`` says why).
        ``greedy`` a bool [n] array: ``(ids, logits)``, the greedy ids of every marked row and
        the logits of the marked rows whose ``greedy`` is False only (engine_api.Engine.forward)."""
        greedy = bool(greedy) if isinstance(greedy, (bool, np.bool_)) else np.asarray(greedy, np.bool_)
        try:
            logits = self.context.forward(np.asarray(tokens, np.int32), np.asarray(positions, np.int32),
                                          np.asarray(seq_ids, np.int32), np.asarray(want_logits, np.bool_),
                                          greedy=greedy)
        except _native.ContextOverflow as e:
            raise ContextOverflow(str(e)) from None
        if self.model.n_expert and time.monotonic() - self._expert_snapshot_at >= self.EXPERT_SNAPSHOT_S:
            self._expert_snapshot = self.expert_counts()
            self._expert_snapshot_at = time.monotonic()
            if self.gpu is not None and self.gpu.backend != "cpu":
                self._hybrid_snapshot = self.context.hybrid_stats()
        return logits

    def score(self, tokens: np.ndarray, positions: np.ndarray, seq_ids: np.ndarray,
              targets: np.ndarray) -> np.ndarray:
        """Perplexity: runs a batch like ``forward`` and returns float64 [n_scored], the negative
        log-likelihood -log softmax(logits of row i)[targets[i]] of every row with targets[i] >= 0
        (-1: not scored), computed natively (the logits never reach Python). ContextOverflow as
        forward; ValueError for a bad row or target."""
        try:
            return self.context.score(np.asarray(tokens, np.int32), np.asarray(positions, np.int32),
                                      np.asarray(seq_ids, np.int32), np.asarray(targets, np.int32))
        except _native.ContextOverflow as e:
            raise ContextOverflow(str(e)) from None

    def pin_forward_thread(self) -> bool:
        """On a pool that spans several NUMA nodes, pin the calling thread, which must run every
        forward from now on (the pool's tid 0), to the pool's first CPU, as the pool pins its
        workers: its share of each op then reads that node's weights. Returns whether it pinned
        (not on one node); OSError if the CPU cannot be taken."""
        return bool(self.model.pin_forward_thread())

    @property
    def forward_cpu(self) -> int:
        """The CPU ``pin_forward_thread`` pinned the forward thread to, -1 when not pinned."""
        return int(self.model.forward_cpu)

    def free_seq(self, seq_id: int) -> None:
        self.context.free_seq(seq_id)

    def copy_seq(self, src: int, dst: int, n_tokens: int) -> None:
        self.context.copy_seq(src, dst, n_tokens)

    def seq_len(self, seq_id: int) -> int:
        return self.context.seq_len(seq_id)


def placement_options(config: Any) -> dict[str, Any]:
    """Engine.open's placement keywords from a ``ktd.ops.config.Config``: model.numa_nodes, smt,
    hugepages, hugepage_size, mlock, weights_cache, weights_cache_map, weights_map and the numa section."""
    mc, nc = config.model, config.numa
    return {"nodes": list(mc.numa_nodes), "smt": mc.smt, "hugepages": mc.hugepages,
            "hugetlb_page_size": HUGETLB_PAGE_SIZES[mc.hugepage_size], "mlock": mc.mlock,
            "numa_experts": nc.experts, "numa_dense": nc.dense, "weights_cache": mc.weights_cache,
            "cache_map": mc.weights_cache_map, "weights_map": ktd_config.effective_weights_map(mc)[0]}


def load(config: Any, progress: Progress) -> Engine:
    """The daemon's factory: ``config.model`` gives path, n_ctx, n_seq_max, threads and the memory
    placement (with ``config.numa``); ``config.gpu`` the hybrid CPU + GPU forward (ktd.model.gpu: decided
    before the weights are read; ktd.model.gpu.GpuError for a plan over budget or a required GPU that
    cannot be used)."""
    from ktd.model import gpu
    mc = config.model
    if not mc.path:
        raise ValueError("model.path is not set")
    decision = gpu.decide(config)
    _, why = ktd_config.effective_weights_map(mc)
    if why:
        log.info("weights map: %s", why)
    engine = Engine.open(mc.path, n_ctx=mc.n_ctx, n_seq_max=mc.n_seq_max, threads=mc.threads, progress=progress,
                         cache_in_background=True, cache_slots=config.prefix_cache.slots,
                         **placement_options(config))
    _set_backend(engine, decision, config.gpu)
    engine.gpu = decision
    return engine


def _set_backend(engine: Engine, decision: Any, g: Any) -> None:
    """The GPU decision's backend on the engine's context (decision.backend becomes cpu, with the
    reason, when an optional device cannot be used)."""
    from ktd.model import gpu
    if decision.backend == "cuda":
        budget = 0 if g.vram_budget == "auto" else int(g.vram_budget)
        try:
            kw = {"device": decision.device, "vram_budget": budget, "layers": g.layers, "experts": decision.held}
            engine.context.set_backend(gpu.cuda_backend_name(), **kw)
            engine.backend_args = (gpu.cuda_backend_name(), kw)
        except _native.DeviceError as e:  # an unsupported architecture, the device's memory, a device fault
            if g.required:
                raise gpu.GpuError(f"gpu.required is set and gpu.device {decision.device} cannot be used: {e}") from e
            log.warning("gpu.device %s cannot be used, running on the CPU only: %s (set gpu.required: true to "
                        "refuse to start instead)", decision.device, e)
            decision.backend, decision.reason = "cpu", str(e)
    elif decision.backend != "cpu":
        kw = {"layers": g.layers, "experts": decision.held}
        engine.context.set_backend(decision.backend, **kw)
        engine.backend_args = (decision.backend, kw)
    if decision.backend == "cpu":
        return
    # Between two MoE layers the pool idles while the device runs the dense part: its workers keep
    # spinning through that gap instead of sleeping and being woken once per layer.
    engine.context.pool_spin_us = engine.pool_spin_us = decision.pool_spin_us = g.pool_spin_us


HUGETLB_PAGE_SIZES = {"2M": 2 << 20, "1G": 1 << 30}


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.4g} {unit}"
    return f"{n} bytes"


def numa_summary(mem: dict[str, Any]) -> dict[str, Any]:
    """The node layout for status: per NUMA node its threads, routed-expert bytes and (dense:
    replicate) the bytes of its copy of the dense weights."""
    return {"nodes": [{"node": n["node"], "threads": n["threads"], "expert_bytes": int(n["expert_bytes"]),
                       "dense_copy_bytes": int(n["dense_copy_bytes"]), "bound": n["bound"],
                       **({"note": n["note"]} if n["note"] else {})} for n in mem["nodes"]],
            "experts": "shard" if mem["experts_sharded"] else "off",
            "dense": mem["dense_policy"], **({"dense_note": mem["dense_note"]} if mem["dense_note"] else {})}


_PAGE_KINDS = {
    "hugetlb_2M": "reserved huge pages of 2 MiB",
    "hugetlb_1G": "reserved huge pages of 1 GiB",
    "thp": "4 KiB pages + transparent huge pages (MADV_HUGEPAGE, best effort)",
    "normal": "4 KiB pages",
}


# Below this share of the arenas' resident bytes on huge pages, the load warns (log_memory).
HUGE_SHARE_WARN = 0.9


def arena_huge_pages(model: "_native.Model") -> dict[str, Any]:
    """What the kernel gives the weights arenas now (Model.arena_pages, read from smaps, not
    assumed): resident bytes, bytes on huge pages (transparent, reserved, or a mapped cache
    entry's PMD mappings) and their share; None values without arenas (weights_map: gguf)."""
    p = model.arena_pages()
    hugetlb = int(p.get("Private_Hugetlb", 0)) + int(p.get("Shared_Hugetlb", 0))
    resident = int(p.get("Rss", 0)) + hugetlb
    huge = int(p.get("AnonHugePages", 0)) + int(p.get("FilePmdMapped", 0)) + hugetlb
    if not p:
        return {"resident_bytes": None, "huge_bytes": None, "huge_share": None}
    return {"resident_bytes": resident, "huge_bytes": huge, "huge_share": huge / resident if resident else None}


def weights_map_summary(mem: dict[str, Any]) -> dict[str, Any]:
    """``status``'s view of model.weights_map: the map the load used, the bytes the forward reads
    from the model file's mapping (gguf), and why not the requested map / which tensors were copied."""
    return {"weights_map": mem["weights_map"], "file_mapped_bytes": int(mem["file_bytes"]),
            "weights_map_note": mem["weights_map_note"], "file_copy_note": mem["file_copy_note"]}


def log_memory(model: "_native.Model", hugepages: str = "auto") -> None:
    """One log line for the pages the prepared weights got and why, one for the NUMA layout
    (several nodes), and a warning for each placement the kernel refused; with model.weights_map:
    gguf, what is served from the file (or why the arenas were used after all)."""
    mem = model.memory
    if mem["weights_map"] == "gguf":
        log.info("weights map: gguf: %s of matrices and token_embd served from the model file's mapping "
                 "(its page cache; nothing repacked)", _size(int(mem["file_bytes"])))
        if mem["file_copy_note"]:
            log.warning("weights map: gguf: %s", mem["file_copy_note"])
    elif mem["weights_map_note"]:
        log.warning("weights map: %s", mem["weights_map_note"])
    if mem["page_kind"]:
        why = f"; not better because: {mem['page_reason']}" if mem["page_reason"] else ""
        log.info("weights memory (hugepages: %s): %s%s", hugepages,
                 _PAGE_KINDS.get(mem["page_kind"], mem["page_kind"]), why)
        got = arena_huge_pages(model)
        if got["huge_share"] is not None and got["huge_share"] < HUGE_SHARE_WARN:
            log.warning("weights memory: only %s of the arenas' %s resident bytes are on huge pages (%.0f%%): the "
                        "kernel had no free 2 MiB pages at the load (memory fragmented), and decode streams the "
                        "rest from 4 KiB pages, slower; reserved huge pages (vm.nr_hugepages, hugepages: auto or "
                        "hugetlb) cannot be refused or split later", _size(got["huge_bytes"]),
                        _size(got["resident_bytes"]), 100 * got["huge_share"])
    nodes = mem["nodes"]
    if len(nodes) > 1:
        layout = ", ".join(f"node {n['node']}: {n['threads']} threads, experts {_size(int(n['expert_bytes']))}"
                           for n in nodes)
        log.info("NUMA: %d nodes (%s); experts %s; dense weights %s (%s)", len(nodes), layout,
                 "sharded by row slices" if mem["experts_sharded"] else "not sharded", mem["dense_policy"],
                 _size(int(mem["dense_bytes"])))
        for n in nodes:
            if n["note"]:
                log.warning("NUMA node %d expert slice: %s", n["node"], n["note"])
        if mem["dense_note"]:
            log.warning("NUMA dense weights: %s", mem["dense_note"])
