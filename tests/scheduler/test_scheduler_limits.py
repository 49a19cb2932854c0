"""Property-based tests of the Scheduler against its stated limits (pure Python, no model).

Random workloads (arrivals, shared prefixes, parallel sampling ``n``, priorities, aborts, small
pools that force preemption) are driven step by step, the way ``kvos.sim.simulator`` does, with
fake sampled tokens. At every step the scheduler must respect the token budget, ``max_num_seqs``
(forks of ``n > 1`` included), compute only tokens a sequence has, keep KV block accounting
consistent, and the workload must finish (no livelock) with every request's outputs complete.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

from kvos.cache import FullAttentionSpec, KVCacheManager
from kvos.core.request import Request, RequestStatus
from kvos.core.sampling_params import SamplingParams
from kvos.scheduler.scheduler import Scheduler, SchedulerConfig, SchedulerOutput

VOCAB = 50


@dataclass
class Spec:
    arrival: int
    prompt_len: int
    prefix: int | None  # which shared prefix the prompt starts with (None: none)
    prefix_frac: float
    max_tokens: int
    n: int
    priority: int


request_st = st.builds(
    Spec,
    arrival=st.integers(0, 12),
    prompt_len=st.one_of(st.integers(1, 40), st.integers(1, 80), st.integers(1, 300)),
    prefix=st.one_of(st.none(), st.integers(0, 2)),
    prefix_frac=st.floats(0.0, 1.0),
    max_tokens=st.integers(1, 40),
    n=st.one_of(st.just(1), st.integers(1, 4)),
    priority=st.integers(0, 3),
)

workload_st = st.fixed_dictionaries({
    "block_size": st.sampled_from([4, 8, 16]),
    "pool_tokens": st.integers(8, 400),  # the pool holds about this many tokens
    "max_num_batched_tokens": st.integers(8, 256),
    "max_num_seqs": st.integers(1, 8),
    "policy": st.sampled_from(["fcfs", "priority", "lpm"]),
    "preemption_order": st.sampled_from(["latest", "least_progress"]),
    "fairness_steps": st.integers(1, 12),
    "enable_caching": st.booleans(),
    "seed": st.integers(0, 2**16),
    "requests": st.lists(request_st, min_size=1, max_size=10),
    "aborts": st.lists(st.tuples(st.integers(0, 60), st.integers(0, 9)), max_size=3),
    "prereject": st.booleans(),  # False: prompts the pool cannot hold reach the scheduler too
})


# -- invariant helpers ---------------------------------------------------------------------
def check_block_accounting(sched: Scheduler) -> None:
    """Running sequences' tables cover their computed tokens with referenced (non-free)
    blocks; every block's ref count is the number of tables holding it; the pool adds up;
    sequences that are not running hold no block."""
    kv = sched.kv
    bs = kv.block_size
    refs: dict[int, int] = {}
    for req in sched.running:
        assert req.status == RequestStatus.RUNNING
        table = kv.block_tables(req.request_id)[0]
        assert len(table) * bs >= req.num_computed_tokens, (req.request_id, len(table), req.num_computed_tokens)
        for b in table:
            assert not b.is_null and b.ref_cnt >= 1, (req.request_id, b)
            assert not kv.pool.is_free(b), (req.request_id, b)
            refs[b.block_id] = refs.get(b.block_id, 0) + 1
    for rid, req in sched.requests.items():
        if req.status != RequestStatus.RUNNING:
            assert not kv.block_tables(rid)[0], f"{rid} ({req.status}) still holds blocks"
    for block in kv.pool.blocks[1:]:
        assert block.ref_cnt == refs.get(block.block_id, 0), block
        assert kv.pool.is_free(block) == (block.ref_cnt == 0), block
    u = kv.usage()
    assert u.total == u.free + u.cached + u.used, u
    assert u.used == len(refs), (u, len(refs))


def check_step(sched: Scheduler, out: SchedulerOutput, before: dict[str, tuple[RequestStatus, int, int]]) -> None:
    cfg, kv = sched.config, sched.kv
    bs = kv.block_size
    # 1. the token budget
    assert out.num_batched_tokens <= cfg.max_num_batched_tokens, (out.num_batched_tokens, cfg)
    # 2. max_num_seqs: sequences computing now, and running ones (new forks included)
    assert len(out.seqs) <= cfg.max_num_seqs, (len(out.seqs), cfg.max_num_seqs)
    assert len(sched.running) + len(sched.loading) <= cfg.max_num_seqs, \
        ([r.request_id for r in sched.running], cfg.max_num_seqs)
    # 3. each sequence computes only tokens it has, from where it stood
    ids = [s.request.request_id for s in out.seqs]
    assert len(ids) == len(set(ids))
    preempted = {r.request_id for r in out.preempted}
    for s in out.seqs:
        req = s.request
        rid = req.request_id
        assert rid not in preempted and req.status == RequestStatus.RUNNING and req in sched.running
        status, computed, num_tokens = before[rid]
        assert s.num_new_tokens >= 1, (rid, s.num_new_tokens)
        assert s.start + s.num_new_tokens <= num_tokens, (rid, s.start, s.num_new_tokens, num_tokens)
        if status == RequestStatus.RUNNING:
            assert s.start == computed, (rid, s.start, computed)
        else:  # just admitted: it starts after a prefix hit of whole cached blocks of its own tokens
            assert status == RequestStatus.WAITING and computed == 0, (rid, status, computed)
            if cfg.scheduling_policy == "lpm":  # fairness: no earlier arrival still waits past its bound
                for _, w in sched._waiting:
                    if (w.arrival, w.sample_index) < (req.arrival, req.sample_index):
                        assert sched.num_steps - w.queued_at_step < cfg.fairness_steps, (w.request_id, rid)
            assert s.start % bs == 0 and s.start < num_tokens, (rid, s.start)
            hashes = kv.block_hashes(req)
            table = kv.block_tables(rid)[0]
            for i in range(s.start // bs):
                assert table[i].block_hash == hashes[i], (rid, i)
        assert req.num_computed_tokens == s.start + s.num_new_tokens
        assert bool(s.samplers) == (s.start + s.num_new_tokens == num_tokens), (rid, s.samplers)
    for r in out.preempted:
        assert r.status == RequestStatus.WAITING and r.num_computed_tokens == 0
    if cfg.preemption_order == "least_progress" and out.preempted:  # lowest priority, then least progress lost
        first = out.preempted[0]
        for r in sched.running:
            if r.request_id not in before:  # forked this step
                continue
            if r.priority > first.priority:
                raise AssertionError(f"{first.request_id} preempted before lower-priority {r.request_id}")
            if r.priority == first.priority:
                assert before[r.request_id][1] >= before[first.request_id][1], (first.request_id, r.request_id)
    # 4. blocks
    check_block_accounting(sched)


def record_events(sched: Scheduler, seen: dict[str, Request], specs: list[Spec], rejected: set[str], step: int) -> None:
    cut = any(r.status == RequestStatus.FINISHED_LENGTH and r.num_output_tokens < specs[int(r.parent_id[1:])].max_tokens
              for r in seen.values())
    event(f"steps ~{1 << step.bit_length()}")
    event(f"preemptions: {'yes' if sched.kv.counters.preemptions else 'no'}")
    event(f"forked: {'yes' if any(r.sample_index for r in seen.values()) else 'no'}")
    event(f"rejected: {'yes' if rejected else 'no'}")
    event(f"cut short by the pool: {'yes' if cut else 'no'}")


# -- the driver ----------------------------------------------------------------------------
def run_workload(w: dict) -> None:
    rng = random.Random(w["seed"])
    bs = w["block_size"]
    prefixes = [[rng.randrange(VOCAB) for _ in range(300)] for _ in range(3)]
    num_blocks = 1 + max(2, -(-w["pool_tokens"] // bs))  # block 0 is the null block
    kv = KVCacheManager(FullAttentionSpec(bs, 1, 1, 1), num_blocks, "m", w["enable_caching"], "lru")
    cfg = SchedulerConfig(w["max_num_batched_tokens"], w["max_num_seqs"], w["policy"],
                          w.get("preemption_order", "latest"), w.get("fairness_steps", 64))
    sched = Scheduler(cfg, kv)
    capacity = kv.capacity_tokens(cfg.max_num_batched_tokens)

    specs: list[Spec] = w["requests"]
    prompts = []
    for spec in specs:
        k = 0 if spec.prefix is None else int(spec.prefix_frac * spec.prompt_len)
        head = prefixes[spec.prefix][:k] if spec.prefix is not None else []
        prompts.append(head + [rng.randrange(VOCAB) for _ in range(spec.prompt_len - k)])

    arrivals = sorted(range(len(specs)), key=lambda i: specs[i].arrival)
    aborts = sorted(w["aborts"])
    added: dict[str, Request] = {}  # group id -> its first sequence
    rejected: set[str] = set()
    aborted: set[str] = set()
    last_arrival = max(s.arrival for s in specs)
    work = sum(s.n * (len(p) + s.max_tokens) for s, p in zip(specs, prompts))
    bound = last_arrival + 3 * work + 50
    step = nxt = 0
    empty_run = 0
    seen: dict[str, Request] = {}
    while nxt < len(arrivals) or sched.has_unfinished():
        assert step <= bound, f"no progress after {step} steps (bound {bound})"
        while nxt < len(arrivals) and specs[arrivals[nxt]].arrival <= step:
            i = arrivals[nxt]
            nxt += 1
            spec, gid = specs[i], f"r{i}"
            req = Request(gid, prompts[i], SamplingParams(n=spec.n, max_tokens=spec.max_tokens, ignore_eos=True),
                          priority=spec.priority)
            if len(prompts[i]) + 1 > capacity:
                rejected.add(gid)
                if w.get("prereject", True):  # the engine rejects such a prompt up front
                    continue
            if spec.n > cfg.max_num_seqs:  # can never run all its sequences at once
                with pytest.raises(ValueError, match="max_num_seqs"):
                    sched.add_request(req)
                rejected.add(gid)
                assert gid not in sched.requests
                continue
            sched.add_request(req)
            added[gid] = req
            seen[gid] = req
        while aborts and aborts[0][0] <= step:
            _, j = aborts.pop(0)
            gid = f"r{j}"
            if gid in added:  # abort every sequence of the request, as the engine does
                aborted.add(gid)
                for rid, seq in list(sched.requests.items()):
                    if seq.parent_id == gid:
                        sched.finish_request(rid, RequestStatus.FINISHED_ABORTED)
                check_block_accounting(sched)
        step += 1
        if not sched.has_unfinished():
            continue
        before = {rid: (r.status, r.num_computed_tokens, r.num_tokens) for rid, r in sched.requests.items()}
        out = sched.schedule()
        seen.update(sched.requests)  # forks appear here (and may finish in this step's update)
        check_step(sched, out, before)
        if out.is_empty and not out.finished_ids:  # a step that only rejects a request still progresses
            empty_run += 1
            # an empty step may follow a preemption; several in a row with nothing arriving is a stall
            assert empty_run < 3 or nxt < len(arrivals) or aborts, "scheduler stalled"
        else:
            empty_run = 0
        sampled = {}
        for s in out.seqs:
            for t in s.samplers:
                sampled[t.request_id] = (hash((t.request_id, t.num_output_tokens)) & 0x7FFF) % VOCAB
        for t in sched.update_from_output(out, sampled):
            assert t.num_pending == 0
        for req in sched.running:
            assert req.num_pending == 0
        seen.update(sched.requests)
        check_block_accounting(sched)

    if currently_in_test_context():  # what the workloads exercised (--hypothesis-show-statistics)
        record_events(sched, seen, specs, rejected, step)
    # 5. everything finished, with complete outputs unless aborted or too long for the pool
    assert not sched.requests and not sched.running and not sched.loading and not sched.num_waiting()
    u = kv.usage()
    assert u.used == 0 and u.free + u.cached == u.total
    groups: dict[str, list[Request]] = {}
    for req in seen.values():
        groups.setdefault(req.parent_id, []).append(req)
    assert set(groups) <= set(added)
    for gid, first in added.items():
        spec = specs[int(gid[1:])]
        seqs = groups.get(gid, [first])
        for req in seqs:
            assert req.is_finished, (req.request_id, req.status)
        if gid in aborted:
            continue
        if gid not in rejected:  # (a prompt the pool cannot hold may be cut off before it forks)
            assert len(seqs) == spec.n, (gid, len(seqs), spec.n)
            assert sorted(r.sample_index for r in seqs) == list(range(spec.n))
        for req in seqs:
            if req.num_output_tokens == spec.max_tokens:
                assert req.status == RequestStatus.FINISHED_LENGTH
            else:  # only the pool's size may cut it short (alone, it could not grow)
                assert req.status == RequestStatus.FINISHED_LENGTH and len(req.all_token_ids) > capacity, \
                    (req.request_id, req.status, req.num_output_tokens, spec.max_tokens, capacity)
                assert req.num_output_tokens < spec.max_tokens


pressure_st = st.fixed_dictionaries({  # many short requests, a tiny pool: preemption and forks
    "block_size": st.sampled_from([4, 8]),
    "pool_tokens": st.integers(8, 96),
    "max_num_batched_tokens": st.integers(8, 64),
    "max_num_seqs": st.integers(4, 8),
    "policy": st.sampled_from(["fcfs", "priority", "lpm"]),
    "preemption_order": st.sampled_from(["latest", "least_progress"]),
    "fairness_steps": st.integers(1, 12),
    "enable_caching": st.booleans(),
    "seed": st.integers(0, 2**16),
    "requests": st.lists(st.builds(Spec, arrival=st.integers(0, 4), prompt_len=st.integers(1, 40),
                                   prefix=st.one_of(st.none(), st.integers(0, 1)), prefix_frac=st.floats(0.0, 1.0),
                                   max_tokens=st.integers(1, 40), n=st.integers(1, 4), priority=st.integers(0, 3)),
                         min_size=2, max_size=8),
    "aborts": st.lists(st.tuples(st.integers(0, 40), st.integers(0, 7)), max_size=2),
})

_settings = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@settings(max_examples=60, **_settings)
@given(workload_st)
def test_scheduler_respects_its_limits(w):
    run_workload(w)


@settings(max_examples=40, **_settings)
@given(pressure_st)
def test_scheduler_respects_its_limits_under_memory_pressure(w):
    run_workload(w)


def _workload(requests, **kw) -> dict:
    return {"block_size": 4, "pool_tokens": 400, "max_num_batched_tokens": 8, "max_num_seqs": 3, "policy": "fcfs",
            "enable_caching": True, "seed": 0, "aborts": [], "requests": requests, **kw}


def _spec(arrival=0, prompt_len=4, max_tokens=4, n=1, priority=0) -> Spec:
    return Spec(arrival, prompt_len, None, 0.0, max_tokens, n, priority)


def test_admission_keeps_room_for_forks_of_a_chunked_prompt():
    """Regression: the n - 1 forks of a prompt joined ``running`` at its end without regard to
    ``max_num_seqs``; requests admitted while it was still prefilling (in chunks) took their room."""
    run_workload(_workload([_spec(prompt_len=40, n=3), _spec(arrival=1), _spec(arrival=1)]))
    run_workload(_workload([_spec(), _spec(n=2), _spec(n=2)], max_num_seqs=2))


def test_n_above_max_num_seqs_is_rejected():
    sched = Scheduler(SchedulerConfig(64, 2), KVCacheManager(FullAttentionSpec(4, 1, 1, 1), 16, "m"))
    with pytest.raises(ValueError, match="max_num_seqs"):
        sched.add_request(Request("a", [1, 2, 3], SamplingParams(n=3)))
    assert not sched.requests and not sched.has_unfinished()
    sched.add_request(Request("b", [1, 2, 3], SamplingParams(n=2)))


@pytest.mark.parametrize("fairness_steps", [2, 5])
def test_lpm_admits_a_request_overtaken_for_fairness_steps(fairness_steps):
    """A prompt with no cached prefix waits behind a stream of later arrivals that all hit the
    cache. LPM alone would admit every one of them first; the bound admits it as soon as it has
    waited ``fairness_steps`` steps and a seat is free."""
    kv = KVCacheManager(FullAttentionSpec(4, 1, 1, 1), 200, "m")
    sched = Scheduler(SchedulerConfig(64, 1, "lpm", fairness_steps=fairness_steps), kv)
    shared = list(range(100, 140))
    params = SamplingParams(max_tokens=1, ignore_eos=True)

    def run_step() -> list[str]:
        out = sched.schedule()
        admitted = [s.request.request_id for s in out.seqs if s.start < s.request.num_prompt_tokens]
        sched.update_from_output(out, {t.request_id: 7 for s in out.seqs for t in s.samplers})
        return admitted

    sched.add_request(Request("warm", shared + [1], params))
    while sched.has_unfinished():
        run_step()
    sched.add_request(Request("cold", list(range(500, 540)), params))
    queued = sched.num_steps
    admitted_at = None
    for i in range(30):
        sched.add_request(Request(f"hit{i}", shared + [2 + i], params))
        if "cold" in run_step():
            admitted_at = sched.num_steps
            break
    assert admitted_at is not None, "the cold request starved"
    assert admitted_at - queued <= fairness_steps + 1
