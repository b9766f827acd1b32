"""Hostile input, second round, at the daemon: a request the async client cannot encode, a
grammar that cannot run, and users who must not learn each other's prompts from the prefix
cache. The daemon is the real process with the fake engine (tests/daemon_helpers.py)."""

from __future__ import annotations

import asyncio
import os

import msgpack
import pytest

from daemon_helpers import DaemonProcess, reply_as_uid
from grammar_inputs import wide_rows
from ktd.client import AsyncClient, BadRequest
from ktd.server import protocol
from ktd.server.prefix_cache import PrefixCache

DAEMON = dict(model={"n_ctx": 256, "n_seq_max": 2})  # the module's daemon (conftest)


# --- the async client: a request it cannot encode -------------------------------------------------

@pytest.mark.parametrize("params", [{"seed": 2**64}, {"seed": -(2**70)}, {"stop": ["\ud800"]},
                                    {"prompt": "a\udcff"}])
def test_an_unencodable_request_is_bad_request_and_leaves_nothing_behind(daemon, params):
    """The client registered the request's msgid before packing it and never removed it: each
    such request kept a future (and logged "Future exception was never retrieved")."""
    async def go():
        c = await AsyncClient.connect(daemon.socket, timeout=30)
        try:
            for _ in range(3):
                with pytest.raises(BadRequest, match="cannot be encoded"):
                    await c.stream(**{"prompt": "x", "max_tokens": 2, **params})
                with pytest.raises(BadRequest, match="cannot be encoded"):
                    await c.call("generate", **{"prompt": "x", "max_tokens": 2, "stream": False, **params})
            assert not c._waiters and not c._streams
            assert (await c.generate("fine", max_tokens=2))["usage"]["completion_tokens"] == 2
        finally:
            await c.close()

    asyncio.run(go())


# --- grammars that cannot run, over the socket ---------------------------------------------------------

def test_a_grammar_over_the_engine_limits_is_refused_as_bad_request(daemon):
    with daemon.client(timeout=60) as c:
        with pytest.raises(BadRequest, match="max_items_in_row"):
            c.generate("x", grammar={"lark": wide_rows(2500)}, max_tokens=4)
        with pytest.raises(BadRequest, match="nested"):
            c.generate("x", grammar={"json_schema": "[" * 100_000 + "]" * 100_000}, max_tokens=4)
        assert c.generate("x", max_tokens=2)["usage"]["completion_tokens"] == 2
    assert "Traceback" not in daemon.log()


# --- the prefix cache between users ---------------------------------------------------------------------

SECRET = "The merger with ACME closes on the 14th at 2.1 billion; tell no one. " * 2


def _generate_as(uid: int, sock: str, prompt: str) -> dict:
    reply = reply_as_uid(uid, sock, protocol.pack([0, 1, "generate", [{"prompt": prompt, "max_tokens": 2,
                                                                       "stream": False}]]))
    msg = msgpack.unpackb(reply, raw=False)
    assert msg[2] is None, msg
    return msg[3]


@pytest.mark.skipif(os.geteuid() != 0, reason="connecting as another uid needs root")
@pytest.mark.parametrize("share", [False, True])
def test_another_uid_does_not_reuse_a_users_cached_prompt(share):
    """uid 0 sends a confidential prompt; uid 65534 guessing it must see no cached tokens (with
    them, and the prefill they save, a right guess is told from a wrong one) unless the operator
    shares the cache (prefix_cache.share). The owner still reuses its own entry."""
    d = DaemonProcess(model={"n_ctx": 256, "n_seq_max": 2},
                      server={"allowed_uids": [0, 65534], "socket_mode": 0o666})
    if share:
        d.write_config(prefix_cache={"share": True})
    with d:
        with d.client() as c:
            first = c.generate(SECRET, max_tokens=2)
        assert first["usage"]["cached_tokens"] == 0
        guess = _generate_as(65534, d.socket, SECRET)
        n_prompt = guess["usage"]["prompt_tokens"]
        if share:
            assert guess["usage"]["cached_tokens"] >= n_prompt - 2
        else:
            assert guess["usage"]["cached_tokens"] == 0, guess["usage"]
        with d.client() as c:
            again = c.generate(SECRET, max_tokens=2)
        assert again["usage"]["cached_tokens"] >= n_prompt - 2  # the owner's own reuse still works
        # the other uid's own entry serves that uid
        assert _generate_as(65534, d.socket, SECRET)["usage"]["cached_tokens"] >= n_prompt - 2


def test_a_cache_owner_tag_separates_callers_of_one_connection(daemon):
    """The gateway's callers share its uid: the tag it sends (``cache_owner``: the API key id)
    keeps their entries apart; a tag never reaches another uid's entries (it only narrows)."""
    with daemon.client() as c:
        c.generate(SECRET, max_tokens=2, cache_owner="alice")
        assert c.generate(SECRET, max_tokens=2, cache_owner="bob")["usage"]["cached_tokens"] == 0
        assert c.generate(SECRET, max_tokens=2, cache_owner="alice")["usage"]["cached_tokens"] > 0
        with pytest.raises(BadRequest, match="cache_owner"):
            c.generate("x", max_tokens=2, cache_owner="x" * 300)


class _FakeKV:
    def __init__(self):
        self.copies: list[tuple[int, int, int]] = []

    def copy_seq(self, src, dst, n):
        self.copies.append((src, dst, n))

    def free_seq(self, slot):
        pass


def test_prefix_cache_lookups_see_only_the_owners_entries():
    kv = _FakeKV()
    pc = PrefixCache(kv, slots=[10, 11, 12], max_bytes=0, bytes_per_token=1)
    prompt = list(range(1, 40))
    spare = pc.put(prompt, slot=0, owner="uid:0")
    assert spare != 0
    assert pc.take(prompt + [99], slot=1, owner="uid:1000").n_cached == 0  # another owner: a miss
    assert pc.take(prompt[:20] + [7], slot=1, owner="uid:1000").n_cached == 0
    # another owner's entry that is a prefix of a new one is not dropped by it
    pc.put(prompt + [5, 6], slot=2, owner="uid:1000")
    assert sorted(e.owner for e in pc.entries) == ["uid:0", "uid:1000"]
    r = pc.take(prompt[:20] + [7], slot=3, owner="uid:0")
    assert r.n_cached == 20 and kv.copies[-1][2] == 20
    assert pc.hits == 1 and pc.misses == 2
    # the shared cache (owner None on both sides) is the old behaviour
    shared = PrefixCache(_FakeKV(), slots=[10, 11], max_bytes=0, bytes_per_token=1)
    shared.put(prompt, slot=0, owner=None)
    assert shared.take(prompt + [1], slot=1, owner=None).n_cached == len(prompt)
