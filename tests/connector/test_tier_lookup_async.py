"""Tier lookups run on the tier I/O thread, one batched round trip per request, and are
remembered while a request waits (issue #14, item 7). Real Redis, real engine; no timing
assertions (observations of which thread ran what, and counts)."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from kvos import SamplingParams
from kvos.core.request import RequestStatus
from tests.support.redis_server import RedisServer

SP = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [f"Request {i} of the batch. " + "Explain how page tables map virtual memory. " * 10 for i in range(4)]


@pytest.fixture(scope="module")
def redis_server():
    r = RedisServer()
    yield r
    r.stop()


@pytest.fixture(scope="module")
def reference(make_llm):
    return [o.outputs[0].token_ids for o in make_llm().generate(PROMPTS, SP, use_tqdm=False)]


class RedisObserver:
    """Wraps a ``RedisTier``'s client (observation only): records each round trip (a single
    command, or one pipeline ``execute``), the thread it ran on, whether it ran inside a tier
    lookup, and the time each thread spent in them."""

    def __init__(self, tier, offload) -> None:
        self.trips: list[tuple[int, str, bool, str]] = []  # (thread id, name, in lookup, kind)
        self.blocked_s: dict[int, float] = {}
        self.lookups: list[tuple[int, int]] = []  # (thread id, hashes asked)
        self._in_lookup = threading.local()
        client = tier.client
        execute_command, pipeline = client.execute_command, client.pipeline

        def command(*a, **kw):
            return self._trip("command", execute_command, *a, **kw)

        def make_pipeline(*a, **kw):
            pipe = pipeline(*a, **kw)
            execute = pipe.execute
            pipe.execute = lambda *a2, **kw2: self._trip("pipeline", execute, *a2, **kw2)
            return pipe

        client.execute_command, client.pipeline = command, make_pipeline
        lookup = offload.h.lookup

        def observed_lookup(hashes):
            self.lookups.append((threading.get_ident(), len(hashes)))
            self._in_lookup.on = True
            try:
                return lookup(hashes)
            finally:
                self._in_lookup.on = False

        offload.h.lookup = observed_lookup

    def _trip(self, kind: str, fn, *a, **kw):
        me = threading.current_thread()
        self.trips.append((me.ident, me.name, getattr(self._in_lookup, "on", False), kind))
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            self.blocked_s[me.ident] = self.blocked_s.get(me.ident, 0.0) + time.perf_counter() - t0

    def lookup_trips(self) -> list[tuple[int, str, bool, str]]:
        return [t for t in self.trips if t[2]]

    def reset(self) -> None:
        self.trips.clear()
        self.lookups.clear()


def engine_threads(llm) -> set[int]:
    """Collects the id of every thread that runs the engine's scheduler (its step loop)."""
    seen: set[int] = set()
    llm.engine.schedule_hook = lambda out: seen.add(threading.get_ident())
    return seen


def test_frozen_redis_never_blocks_the_engine_thread(make_llm, redis_server, reference):
    llm = make_llm(num_blocks=64, remote_cache=redis_server.url)
    remote = llm.engine.offload.h.tiers[0]
    obs = RedisObserver(remote, llm.engine.offload)
    engine = engine_threads(llm)
    os.kill(redis_server.proc.pid, signal.SIGSTOP)
    try:
        outs = llm.generate(PROMPTS, SP, use_tqdm=False)
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
        llm.engine.offload.close()
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert remote.stats.errors > 0  # the frozen server was really asked, and timed out
    assert obs.lookups and obs.lookup_trips()  # the observation saw lookups reach Redis
    assert engine and not engine & {t[0] for t in obs.trips}, "a Redis round trip ran on the engine thread"
    assert not engine & {t for t, _ in obs.lookups}, "a tier lookup ran on the engine thread"
    assert {name.startswith("kvos-tier-io") for _, name, _, _ in obs.trips} == {True}
    assert sum(obs.blocked_s.get(t, 0.0) for t in engine) == 0.0  # no tier call there at all
    assert all(o.metrics["cached_tokens_by_source"].get("remote", 0) == 0 for o in outs)


def test_one_pipelined_round_trip_per_request_lookup(make_llm, redis_server, reference):
    llm = make_llm(num_blocks=64, remote_cache=redis_server.url)
    obs = RedisObserver(llm.engine.offload.h.tiers[0], llm.engine.offload)
    n = len(PROMPTS)

    outs = llm.generate(PROMPTS, SP, use_tqdm=False)  # cold: nothing below, nothing on the device
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert len(obs.lookups) == n and all(k >= 2 for _, k in obs.lookups)  # batched: several hashes each
    assert [t[3] for t in obs.lookup_trips()] == ["pipeline"] * n

    llm.engine.reset_prefix_cache()  # the device forgets; Redis still holds every block
    obs.reset()
    outs = llm.generate(PROMPTS, SP, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert all(o.metrics["cached_tokens_by_source"].get("remote", 0) > 0 for o in outs)
    assert len(obs.lookups) == n and [t[3] for t in obs.lookup_trips()] == ["pipeline"] * n

    obs.reset()  # the whole prefix is on the device now: no lookup, no round trip
    outs = llm.generate(PROMPTS, SP, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert obs.lookups == [] and obs.lookup_trips() == []
    llm.engine.offload.close()


def test_a_waiting_request_asks_once(make_llm, redis_server):
    """B cannot get blocks while A runs: it waits many steps, with one lookup."""
    llm = make_llm(num_blocks=14, remote_cache=redis_server.url)
    engine = llm.engine
    obs = RedisObserver(engine.offload.h.tiers[0], engine.offload)
    a = engine.add_request("Request A. " + "Describe the buddy allocator. " * 22,
                           SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    b = engine.add_request("Request B. " + "Describe the slab allocator. " * 12, SP)
    waited_with_answer = 0

    def hook(out) -> None:
        nonlocal waited_with_answer
        req = engine.scheduler.requests.get(b)
        entry = engine.offload.lookups.get(b)
        if req is not None and req.status == RequestStatus.WAITING and entry is not None and entry.answer.done():
            waited_with_answer += 1

    engine.schedule_hook = hook
    finished = set()
    for _ in range(1000):
        if not engine.has_unfinished_requests():
            break
        finished |= {o.request_id for o in engine.step() if o.finished}
    assert finished == {a, b}
    assert waited_with_answer >= 3  # B really waited for room, several steps, answer in hand
    assert len(obs.lookups) == 2  # A's and B's, each once
    assert len(obs.lookup_trips()) == 2
    engine.offload.close()
