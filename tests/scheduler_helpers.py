"""Driving the scheduler in-process (ktd.server.scheduler) the way the daemon does: a job's sink
that collects what it is sent, a tokenizer proxy that records the token ids a request generated,
and a greedy job run to its end."""

from __future__ import annotations

import threading

from ktd.server.scheduler import Job, Scheduler
from ktd.text.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


class Collector:
    """A job's sink: the text chunks in order, then the end (kind "done" or an error) and its payload."""

    def __init__(self):
        self.chunks: list[str] = []
        self.end = threading.Event()
        self.kind = None
        self.payload = None

    def __call__(self, kind, payload):
        if kind == "chunk":
            self.chunks.append(payload)
        else:
            self.kind, self.payload = kind, payload
            self.end.set()

    def wait(self, timeout=30):
        assert self.end.wait(timeout), "job did not end"
        return self.kind, self.payload


class RecordingTokenizer:
    """A tokenizer proxy whose stream decoders record the token ids they are fed (the scheduler
    feeds every sampled token to its sequence's decoder): the generated ids of each request."""

    def __init__(self, tok):
        self._tok = tok
        self.outputs: list[list[int]] = []

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def decode_stream(self):
        inner, ids = self._tok.decode_stream(), []
        self.outputs.append(ids)

        class D:
            def feed(self, t):
                ids.append(t)
                return inner.feed(t)

            def flush(self):
                return inner.flush()
        return D()


def run_greedy_job(s: Scheduler, rec: RecordingTokenizer, prompt: list[int],
                   max_tokens: int) -> tuple[list[int], dict]:
    """Submit prompt as a greedy job of max_tokens (end of text ignored) and wait for its end: the
    ids it generated (rec must be the engine's tokenizer) and its usage."""
    sink = Collector()
    s.submit(Job(client=1, prompt=list(prompt), sampling=GREEDY, max_tokens=max_tokens, stop=(),
                 ignore_eos=True, sink=sink))
    kind, payload = sink.wait(300)
    assert kind == "done", payload
    return rec.outputs[-1], payload["usage"]
