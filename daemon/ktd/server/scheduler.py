"""Continuous batching on a dedicated engine thread.

The event loop submits ``Job``s (already tokenized and admitted, ``ktd.server.admission``); the engine
thread hands their events (``ktd.server.events``) to the one ``deliver`` it was given, and never hears
back about them. Each step the engine thread:

1. applies cancellations and expired deadlines (their KV slots are freed before the step);
2. admits waiting jobs into free KV slots, fairly: the waiting job whose client holds the fewest
   slots goes first, then the client served longest ago (round robin), then arrival order;
3. builds one batch: one decode token of every running sequence, plus a chunk of pending prompt
   tokens (prefill) up to ``prefill_tokens_per_step`` shared by the prompts in admission order;
4. calls ``engine.forward`` once (the GIL is released there) and samples the rows it marked.

A job ends with exactly one terminal event: ("done", result) or ("error", KtdError). Before it,
("chunk", text) events carry the generated text in order. The events of one step are handed over
together: ``deliver(events)`` is called once per step on the engine thread with the list of
``(sink, kind, payload)``; the default calls each sink there, the server's posts the whole list
to its event loop with one ``call_soon_threadsafe`` (one loop wakeup per step, not per token).
"""

from __future__ import annotations

import collections
import contextlib
import concurrent.futures
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ktd.server.engine_api import Engine, WeightsSwitch
from ktd.errors import Busy, Cancelled, ContextOverflow, Internal, KtdError
from ktd.server.events import Deliver, Event, Sink, call_sinks
from ktd.server.prefix_cache import PrefixCache
from ktd.text.sampling import Constraint, Generation, SamplingParams

log = logging.getLogger("ktd.server.scheduler")

# The default hand-off: every sink called on the engine thread (in-process use and tests).
deliver_here: Deliver = call_sinks
__all__ = ["Deliver", "Event", "Job", "Scheduler", "Sink", "deliver_here"]

_TPS_WINDOW_S = 10.0                # tokens/s is averaged over this window


@dataclass
class Job:
    """A generate request, tokenized and admitted (``ktd.server.admission.admit``): the scheduler does not
    check it again."""

    client: int                      # connection id (fairness, cancel on disconnect)
    prompt: list[int]
    sampling: SamplingParams
    max_tokens: int                  # already capped so that prompt + max_tokens <= n_ctx
    stop: tuple[str, ...]
    ignore_eos: bool
    sink: Sink
    deadline: float | None = None    # time.monotonic() limit
    label: str = ""                  # request id for logs
    constraint: Constraint | None = None  # the grammar (ktd.text.grammar), compiled at admission
    top_logprobs: int | None = None  # logprobs: alternatives per token (None: off)
    cache_prompt: bool = True        # reuse a cached prefix and keep this sequence's KV (prefix cache)
    cache_owner: str | None = None   # whose cached prefixes it may reuse (None: a shared cache)
    rid: int = field(default=-1)     # assigned by submit
    t_arrival: float = field(default_factory=time.monotonic)


@dataclass
class _Seq:
    job: Job
    gen: Generation
    slot: int
    n_past: int = 0                  # tokens already in this slot's KV cache
    pending: list[int] = field(default_factory=list)  # tokens to feed: prompt rest, or [last sampled]
    n_chunks: int = 0
    t_admit: float = 0.0
    t_first: float | None = None
    cancel_reason: str | None = None
    kv: list[int] = field(default_factory=list)  # tokens whose KV the slot holds (prefix cache)
    n_cached: int = 0                # prompt tokens taken from the prefix cache
    attached: bool = False           # the prefix cache was consulted (after admission)


@dataclass
class _StepRows:
    """A step's batch: one row per token fed, the sequences whose last row is marked (their logits
    or greedy token wanted, in row order) and how many tokens each sequence feeds."""
    tokens: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    seq_ids: list[int] = field(default_factory=list)
    want: list[bool] = field(default_factory=list)
    marked: list[_Seq] = field(default_factory=list)
    fed: list[tuple[_Seq, int]] = field(default_factory=list)
    n_decode: int = 0  # the leading rows that decode (the rest prefill)

    def add(self, seq: _Seq, tokens: list[int], mark: bool) -> None:
        """seq's next tokens as rows; mark: its last row's output is wanted."""
        n = len(tokens)
        self.tokens += tokens
        self.positions += range(seq.n_past, seq.n_past + n)
        self.seq_ids += [seq.slot] * n
        self.want += [False] * (n - 1) + [mark]
        if mark:
            self.marked.append(seq)
        self.fed.append((seq, n))


@dataclass
class _StepOut:
    """The forward's output for the marked rows: greedy[row] says whether the engine chose row's
    token (ids[row]); the others' logits are the rows of ``logits``, in marked-row order."""
    greedy: list[bool]
    ids: np.ndarray | None
    logits: np.ndarray | None

    def check(self, n_marked: int, n_sampled: int) -> None:
        if self.ids is not None and self.ids.shape[0] != n_marked:
            raise RuntimeError(f"engine returned {self.ids.shape[0]} greedy tokens for {n_marked} marked rows")
        if self.logits is not None and self.logits.shape[0] != n_sampled:
            raise RuntimeError(f"engine returned {self.logits.shape[0]} logits rows for {n_sampled} sampled rows")


class _MaskWorker:
    """Computes the grammar masks of a step's constrained rows. With ``overlap`` (the default) on
    a helper thread while the forward runs (llguidance releases the GIL, the forward too);
    without, on the engine thread after the forward (``make bench-sampling`` compares the two).
    ``start(marked)`` returns a handle, ``wait(handle)`` the masks by row. ``wait_seconds``: the
    engine thread's time spent on masks outside the forward (the cost not hidden)."""

    def __init__(self, overlap: bool) -> None:
        self.overlap = overlap
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.wait_seconds = 0.0
        self.rows = 0

    def start(self, marked: list[_Seq]) -> Any:
        work = [(row, seq.gen.constraint) for row, seq in enumerate(marked) if seq.gen.constraint is not None]
        if not work:
            return None
        if not self.overlap:
            return work
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ktd-grammar")
        return self._pool.submit(_fill_masks, work)

    def wait(self, handle: Any) -> dict[int, np.ndarray | KtdError]:
        if handle is None:
            return {}
        t0 = time.monotonic()
        try:
            rows = _fill_masks(handle) if isinstance(handle, list) else handle.result()
        finally:
            self.wait_seconds += time.monotonic() - t0
        self.rows += len(rows)
        return rows

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)


def _fill_masks(work: list[tuple[int, Constraint]]) -> dict[int, np.ndarray | KtdError]:
    """Each row's mask, or the error of a grammar that met a limit computing it (that row only)."""
    out: dict[int, np.ndarray | KtdError] = {}
    for row, c in work:
        try:
            out[row] = c.mask()
        except KtdError as e:
            out[row] = e
    return out


class Scheduler:
    # A weights switch waits for a step with no sequence in flight; after this long without one,
    # new sequences wait in the queue until the running ones end (a busy daemon switches too).
    SWITCH_HOLD_AFTER_S = 60.0

    def __init__(self, engine: Engine, *, prefill_tokens_per_step: int, max_queue: int,
                 deliver: Deliver = deliver_here, overlap_masks: bool = True, prefix_cache_bytes: int = 0,
                 weights: WeightsSwitch | None = None):
        self.engine = engine
        self.weights = weights  # other weights to switch to (model.weights_map: auto after a miss)
        # Engine.forward(..., greedy=True) (the fast path for plain greedy steps), where the engine has it.
        self._engine_greedy = bool(getattr(engine, "supports_greedy", False))
        self.deliver = deliver
        self._outbox: list[Event] = []             # events of the current step (engine thread)
        self.prefill_tokens_per_step = prefill_tokens_per_step
        self.max_queue = max_queue
        self._lock = threading.Condition()
        self._waiting: collections.deque[Job] = collections.deque()
        self._cancels: dict[int, str] = {}         # rid -> reason, applied at the next step
        self._running: dict[int, _Seq] = {}        # rid -> seq (engine thread; size read under lock)
        self._free_slots = list(range(engine.n_seq_max - 1, -1, -1))
        # KV slots beyond n_seq_max hold finished sequences for reuse (ktd.server.prefix_cache).
        self.prefix = PrefixCache(engine, slots=list(range(engine.n_seq_max, engine.n_kv_slots)),
                                  max_bytes=prefix_cache_bytes, bytes_per_token=engine.kv_bytes_per_token)
        self._ids = itertools.count(1)
        self._admissions = itertools.count()
        self._last_admit: dict[int, int] = {}      # client -> admission number of its last job
        self._closed = False
        self._stop = False
        self._thread: threading.Thread | None = None
        # progress, read by the watchdog and status
        self.steps = 0
        self.idle = True
        self.last_progress = time.monotonic()
        self._tps: collections.deque[tuple[float, int]] = collections.deque()
        self.counters = collections.Counter()       # finished_<reason>, prompt_tokens, ...
        # engine-thread time split, seconds (metrics): whole steps, the forward, sampling + hand-off
        self.step_seconds = 0.0
        self.forward_seconds = 0.0
        self.sample_seconds = 0.0
        self._masks = _MaskWorker(overlap_masks)  # grammar masks computed during the forward
        # ``weights`` holds other weights to switch to.
        self._weights_ready = False
        self._weights_ready_at = 0.0
        self.switch_hold_after_s = self.SWITCH_HOLD_AFTER_S
        if weights is not None:
            weights.on_ready(self._wake_for_weights)

    # --- event-loop side (thread-safe) -------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="ktd-engine", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> int:
        """Queue a job; returns its id. Raises Busy when slots and queue are full or closed."""
        with self._lock:
            if self._closed:
                raise Busy("the daemon is shutting down")
            if not self.alive:
                raise Internal("the engine thread is not running")
            in_system = len(self._running) + len(self._waiting)
            if in_system >= self.engine.n_seq_max + self.max_queue:
                raise Busy(f"all {self.engine.n_seq_max} slots busy and {self.max_queue} requests queued")
            job.rid = next(self._ids)
            self._waiting.append(job)
            self._lock.notify()
            return job.rid

    def cancel(self, rid: int, reason: str = "cancelled by the client") -> None:
        with self._lock:
            self._cancels[rid] = reason
            self._lock.notify()

    def close(self) -> None:
        """Refuse new jobs (drain)."""
        with self._lock:
            self._closed = True

    def cancel_all(self, reason: str) -> None:
        with self._lock:
            for rid in list(self._running) + [j.rid for j in self._waiting]:
                self._cancels[rid] = reason
            self._lock.notify()

    def stop(self, timeout: float | None = None) -> None:
        """End the engine thread after the current step (jobs still present are cancelled)."""
        self.cancel_all("the daemon is stopping")
        with self._lock:
            self._stop = True
            self._lock.notify()
        if self._thread:
            self._thread.join(timeout)
        self._masks.close()

    def reconfigure(self, *, prefill_tokens_per_step: int, max_queue: int) -> None:
        with self._lock:
            self.prefill_tokens_per_step = prefill_tokens_per_step
            self.max_queue = max_queue

    def _wake_for_weights(self) -> None:
        with self._lock:
            self._weights_ready = True
            self._weights_ready_at = time.monotonic()
            self._lock.notify()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def pending(self) -> int:
        """Jobs running or waiting."""
        with self._lock:
            return len(self._running) + len(self._waiting)

    def healthy(self, max_stall_s: float) -> bool:
        """For the watchdog: the thread lives and is idle, or has made progress recently."""
        if not self.alive:
            return False
        return self.idle or time.monotonic() - self.last_progress < max_stall_s

    def stats(self) -> dict[str, Any]:
        now = time.monotonic()
        with self._lock:
            tps = [(t, n) for t, n in self._tps if now - t <= _TPS_WINDOW_S]
            return {
                "slots_total": self.engine.n_seq_max,
                "slots_in_use": len(self._running),
                "queued": len(self._waiting),
                "max_queue": self.max_queue,
                "steps": self.steps,
                "tokens_per_s": sum(n for _, n in tps) / _TPS_WINDOW_S,
                "idle": self.idle,
                "prefix_cache": self.prefix.stats(),
            }

    # --- engine thread ----------------------------------------------------------------------

    def _run(self) -> None:
        # this thread runs every forward: the pool's tid 0 (pinned on a multi-node pool)
        try:
            if self.engine.pin_forward_thread():
                log.info("engine thread pinned to CPU %d", self.engine.forward_cpu)
        except OSError as e:
            log.warning("could not pin the engine thread (it stays unpinned): %s", e)
        try:
            while True:
                with self._lock:
                    while not self._stop and not self._running and not self._waiting and not self._weights_ready:
                        self.idle = True
                        self._lock.wait()
                    if self._stop and not self._running and not self._waiting:
                        return
                    # The weights switch: only between steps with no sequence in flight (waiting
                    # jobs are admitted after it), because the new weights come with a new, empty
                    # KV cache: a running sequence would lose its KV (carrying it over would mix
                    # KV computed by other kernels into its continuation). After
                    # switch_hold_after_s without such a step, _admit holds new sequences back.
                    switch = self._weights_ready and not self._running
                    if switch:
                        self._weights_ready = False
                if switch:
                    self._switch_weights()
                    continue
                with self._lock:
                    self.idle = False
                    self.last_progress = time.monotonic()
                    cancels, self._cancels = self._cancels, {}
                    self._apply_cancels(cancels)
                    self._admit()
                self._attach_prefixes()
                self._expire()
                self._flush()  # cancellations and expiries are answered before the forward
                if self._running:
                    self._step()
                self._flush()
        except BaseException:  # a scheduler bug: fail every job rather than hang them
            log.exception("engine thread failed")
            with self._lock:
                for seq in list(self._running.values()):
                    self._finish(seq, error=Internal("engine thread failed"))
                while self._waiting:
                    self._emit(self._waiting.popleft(), "error", Internal("engine thread failed"))
            self._flush()
            raise

    def _switch_weights(self) -> None:
        assert self.weights is not None  # only it wakes the thread for a switch
        try:
            emptied = self.weights.switch()
        except Exception:  # the engine keeps the weights it has; requests go on
            log.exception("weights switch failed")
            return
        if emptied:
            self.prefix.clear()

    def _emit(self, job: Job, kind: str, payload: Any) -> None:
        self._outbox.append((job.sink, kind, payload))

    def _flush(self) -> None:
        if self._outbox:
            events, self._outbox = self._outbox, []
            self.deliver(events)

    def _apply_cancels(self, cancels: dict[int, str]) -> None:
        # under the lock
        if not cancels:
            return
        kept = collections.deque()
        for job in self._waiting:
            reason = cancels.get(job.rid)
            if reason is None:
                kept.append(job)
            else:
                self.counters["finished_cancelled"] += 1
                self._emit(job, "error", Cancelled(reason, data={"usage": {"prompt_tokens": len(job.prompt),
                                                                    "completion_tokens": 0,
                                                                    "cached_tokens": 0}}))
        self._waiting = kept
        for rid, reason in cancels.items():
            seq = self._running.get(rid)
            if seq is not None:
                self._finish(seq, error=Cancelled(reason))

    def _admit(self) -> None:
        # under the lock. Fairness: the client holding the fewest slots goes first, then the one
        # served longest ago (round robin), then arrival order (min() is stable).
        if (self._weights_ready and self._running
                and time.monotonic() - self._weights_ready_at >= self.switch_hold_after_s):
            return  # the running sequences end, the weights switch, then these are admitted
        while self._free_slots and self._waiting:
            held = collections.Counter(s.job.client for s in self._running.values())
            job = min(self._waiting, key=lambda j: (held[j.client], self._last_admit.get(j.client, -1)))
            self._waiting.remove(job)
            self._last_admit[job.client] = next(self._admissions)
            if len(self._last_admit) > 4096:  # forget clients with nothing in the system
                present = {j.client for j in self._waiting} | set(held) | {job.client}
                self._last_admit = {c: n for c, n in self._last_admit.items() if c in present}
            slot = self._free_slots.pop()
            gen = Generation(job.sampling, prompt=job.prompt, eos_ids=self.engine.tokenizer.eos_ids,
                             stop=job.stop, max_tokens=job.max_tokens,
                             decoder=self.engine.tokenizer.decode_stream(), ignore_eos=job.ignore_eos,
                             constraint=job.constraint, top_logprobs=job.top_logprobs)
            self._running[job.rid] = _Seq(job=job, gen=gen, slot=slot, pending=list(job.prompt),
                                          t_admit=time.monotonic())

    def _expire(self) -> None:
        now = time.monotonic()
        for seq in list(self._running.values()):
            if seq.job.deadline is not None and now >= seq.job.deadline:
                self._finish(seq, error=Cancelled("request deadline exceeded"))
        with self._lock:
            expired = [j for j in self._waiting if j.deadline is not None and now >= j.deadline]
            for job in expired:
                self._waiting.remove(job)
                self.counters["finished_cancelled"] += 1
                self._emit(job, "error", Cancelled("request deadline exceeded while queued"))

    def _step(self) -> None:
        t_start = time.monotonic()
        rows = self._gather()
        masks = self._masks.start(rows.marked)  # the grammars' masks, computed while the forward runs
        t0 = time.monotonic()
        out = self._forward(rows, masks)
        if out is None:
            return
        t1 = time.monotonic()
        self.forward_seconds += t1 - t0
        self.steps += 1
        self.last_progress = t1
        for seq, n in rows.fed:
            seq.n_past += n
            seq.kv.extend(seq.pending[:n])
            del seq.pending[:n]
        n_generated = self._accept(rows.marked, out, self._wait_masks(rows.marked, masks), t1)
        with self._lock:
            self._tps.append((t1, n_generated))
            while self._tps and t1 - self._tps[0][0] > _TPS_WINDOW_S:
                self._tps.popleft()
        t2 = time.monotonic()
        self.sample_seconds += t2 - t1
        self.step_seconds += t2 - t_start
        self.counters["generated_tokens"] += n_generated
        self.counters["prompt_tokens"] += len(rows.tokens) - rows.n_decode

    def _gather(self) -> _StepRows:
        """The step's rows: decode tokens first (one per sequence past its prompt), then prefill
        chunks, oldest admission first, within prefill_tokens_per_step."""
        rows = _StepRows()
        prefilling = []
        for seq in self._running.values():
            if seq.n_past >= len(seq.job.prompt):      # decoding: pending = [last sampled token]
                rows.add(seq, seq.pending[:1], mark=True)
            else:
                prefilling.append(seq)
        rows.n_decode = len(rows.tokens)
        budget = self.prefill_tokens_per_step
        for seq in sorted(prefilling, key=lambda s: s.t_admit):
            if budget <= 0:
                break
            n = min(budget, len(seq.pending))
            budget -= n
            rows.add(seq, seq.pending[:n], mark=n == len(seq.pending))
        return rows

    def _forward(self, rows: _StepRows, masks: Any) -> _StepOut | None:
        """The engine's forward of the step. Marked rows whose sequence is plainly greedy take the
        token the engine picks as it writes the logits (Engine.forward(greedy=...);
        Generation.plain_greedy); only the others' logits come back. None when it failed (the
        step's sequences are failed)."""
        greedy = [self._engine_greedy and seq.gen.plain_greedy for seq in rows.marked]
        n_sampled = greedy.count(False)
        args = (np.asarray(rows.tokens, dtype=np.int32), np.asarray(rows.positions, dtype=np.int32),
                np.asarray(rows.seq_ids, dtype=np.int32), np.asarray(rows.want, dtype=np.bool_))
        try:
            if not greedy or n_sampled == len(greedy):
                out = _StepOut(greedy, None, self.engine.forward(*args))
            elif n_sampled == 0:
                out = _StepOut(greedy, self.engine.forward(*args, greedy=True), None)
            else:
                per_row = np.zeros(len(rows.tokens), np.bool_)
                per_row[np.flatnonzero(args[3])] = greedy
                out = _StepOut(greedy, *self.engine.forward(*args, greedy=per_row))
            out.check(len(rows.marked), n_sampled)
        except Exception as e:
            err = e if isinstance(e, ContextOverflow) else Internal(f"engine failure: {type(e).__name__}: {e}")
            log.exception("forward failed; failing the %d sequences of this step", len(rows.fed))
            for seq, _ in rows.fed:
                self._finish(seq, error=err)
            with contextlib.suppress(Exception):  # those sequences have ended
                self._masks.wait(masks)
            return None
        return out

    def _wait_masks(self, marked: list[_Seq], masks: Any) -> dict[int, np.ndarray | KtdError]:
        """The grammars' masks by marked row; on a grammar engine failure those sequences fail, the
        others go on."""
        try:
            return self._masks.wait(masks)
        except Exception as e:
            log.exception("grammar mask failed")
            for seq in marked:
                if seq.gen.constraint is not None:
                    self._finish(seq, error=Internal(f"grammar failure: {e}"))
            return {}

    def _accept(self, marked: list[_Seq], out: _StepOut, masks: dict[int, np.ndarray | KtdError], t1: float) -> int:
        """Each marked sequence takes its next token (the engine's greedy one, or sampled from its
        logits row) and streams its text; returns the tokens generated."""
        n_generated = 0
        k = 0  # the row of out.logits of the next sampled row
        for row, seq in enumerate(marked):
            logits = None
            if not out.greedy[row]:
                logits, k = out.logits[k], k + 1
            if seq.job.rid not in self._running:
                continue
            mask = masks.get(row)
            if isinstance(mask, KtdError):  # its grammar met a limit computing the mask
                self._finish(seq, error=mask)
                continue
            try:
                if logits is None:
                    token, text, finish = seq.gen.accept_token(int(out.ids[row]))
                else:
                    token, text, finish = seq.gen.accept(logits, mask)
            except KtdError as e:  # the request's own grammar refused the token (a limit on its path)
                log.info("%s: %s", seq.job.label, e.message)
                self._finish(seq, error=e)
                continue
            except Exception as e:
                log.exception("sampling failed for %s", seq.job.label)
                self._finish(seq, error=Internal(f"sampling failure: {e}"))
                continue
            n_generated += 1
            if seq.t_first is None:
                seq.t_first = t1
            if text:
                self._emit(seq.job, "chunk", self._chunk(seq, text))
                seq.n_chunks += 1
            if finish is not None:
                self._finish(seq, finish=finish)
            else:
                seq.pending = [token]
        return n_generated

    def _chunk(self, seq: _Seq, text: str) -> Any:
        """A chunk event's payload: the text, or (text, {"logprobs": [...]}) with the log-probabilities
        of the tokens sampled since the last chunk."""
        if seq.gen.top_logprobs is None:
            return text
        return text, {"logprobs": self._logprob_entries(seq)}

    def _logprob_entries(self, seq: _Seq) -> list[dict[str, Any]]:
        text = self._token_text
        return [{"id": t, "token": text(t), "logprob": lp,
                 "top_logprobs": [{"id": i, "token": text(i), "logprob": v}
                                  for i, v in zip(ids.tolist(), top.tolist())]}
                for t, lp, ids, top in seq.gen.take_logprobs()]

    def _token_text(self, token: int) -> str:
        """A token's text for logprobs (control tokens as their text; bytes that are not UTF-8
        on their own as U+FFFD)."""
        return self.engine.tokenizer.token_bytes(token, special=True).decode("utf-8", errors="replace")

    def _summary(self, seq: _Seq, now: float) -> dict[str, Any]:
        j = seq.job
        ms = lambda a, b: round((b - a) * 1e3, 3)  # noqa: E731
        timings = {"queued_ms": ms(j.t_arrival, seq.t_admit), "total_ms": ms(j.t_arrival, now)}
        if seq.t_first is not None:
            timings["ttft_ms"] = ms(j.t_arrival, seq.t_first)
            timings["prefill_ms"] = ms(seq.t_admit, seq.t_first)
            timings["decode_ms"] = ms(seq.t_first, now)
            n_dec = len(seq.gen.output) - 1
            if n_dec > 0 and now > seq.t_first:
                timings["decode_tokens_per_s"] = round(n_dec / (now - seq.t_first), 3)
        return {"usage": {"prompt_tokens": len(j.prompt), "completion_tokens": len(seq.gen.output),
                          "cached_tokens": seq.n_cached},
                "timings": timings}

    def _finish(self, seq: _Seq, *, finish: str | None = None, error: KtdError | None = None) -> None:
        """End a running sequence: free its KV slot, send the terminal event."""
        with self._lock:
            if self._running.pop(seq.job.rid, None) is None:
                return
            self._free_slots.append(self._release_slot(seq, error))
        summary = self._summary(seq, time.monotonic())
        if error is not None:
            self.counters[f"finished_{error.code}"] += 1
            error.data = {**(error.data or {}), **summary}
            self._emit(seq.job, "error", error)
        else:
            self.counters[f"finished_{finish}"] += 1
            result = {"finish_reason": finish, **summary}
            if seq.gen.top_logprobs is not None:  # those not sent with a chunk
                result["logprobs"] = self._logprob_entries(seq)
            self._emit(seq.job, "done", result)

    # --- prefix cache (ktd.server.prefix_cache) -------------------------------------------------------

    def _attach_prefixes(self) -> None:
        """Newly admitted sequences start from the longest cached prefix of their prompt (outside
        the lock: a copy of a long prefix takes milliseconds)."""
        if not self.prefix.enabled:
            return
        for seq in list(self._running.values()):
            if seq.attached:
                continue
            seq.attached = True
            if not seq.job.cache_prompt:
                continue
            try:
                r = self.prefix.take(seq.job.prompt, seq.slot, seq.job.cache_owner)
            except Exception:  # a failed copy: compute the whole prompt instead
                log.exception("prefix cache: reuse failed for %s", seq.job.label)
                self.engine.free_seq(seq.slot)
                continue
            if r.n_cached:
                seq.slot = r.slot
                seq.n_past = seq.n_cached = r.n_cached
                seq.kv = list(seq.job.prompt[:r.n_cached])
                seq.pending = list(seq.job.prompt[r.n_cached:])

    def _release_slot(self, seq: _Seq, error: KtdError | None) -> int:
        """Under the lock: the slot the scheduler gets back for a finished sequence. Its KV goes
        to the prefix cache when it is intact (a normal end or a cancellation between steps; not
        after an engine failure) and the request allows it; the slot handed back is free."""
        slot = seq.slot
        try:
            if (seq.job.cache_prompt and seq.attached and (error is None or isinstance(error, Cancelled))
                    and len(seq.kv) == seq.n_past):
                slot = self.prefix.put(seq.kv, seq.slot, seq.job.cache_owner)
            self.engine.free_seq(slot)
        except Exception:
            log.exception("releasing KV slot %d failed", slot)
        return slot
