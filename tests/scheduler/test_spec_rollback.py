"""Property test of speculative decoding's rollback in the scheduler and the KV memory system
(pure Python): random drafts, a random number of them accepted each step, small pools that
force preemption. After every step the pool adds up, each sequence holds no block past its
tokens (blocks of rejected drafts went back), and every hash in the prefix index is the hash
of tokens that were verified (the requests' own tokens), never of a rejected draft. With a draft
model's cache group beside the target's, every group holds the same blocks' worth of tokens and
obeys the same rules. (The draft's pages are the target's size here: with two page sizes, holes
left in a group's large pages can make a lone sequence stop short of ``capacity_tokens``, which
assumes perfect packing; that is the two-level pool's fragmentation, not rollback's.)"""
from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvos.cache import FullAttentionSpec, KVCacheManager
from kvos.cache.hashing import extend_block_hashes, root_hash
from kvos.cache.layout import single_group_layout, with_draft_group
from kvos.core.request import Request, RequestStatus
from kvos.core.sampling_params import SamplingParams
from kvos.scheduler.scheduler import Scheduler, SchedulerConfig
from tests.scheduler.test_scheduler_limits import check_block_accounting

VOCAB = 20

workload_st = st.fixed_dictionaries({
    "block_size": st.sampled_from([2, 4, 8]),
    "num_blocks": st.integers(6, 60),
    "max_num_batched_tokens": st.integers(4, 64),
    "max_num_seqs": st.integers(1, 6),
    "k": st.integers(1, 6),
    "seed": st.integers(0, 2**16),
    "prompts": st.lists(st.integers(1, 30), min_size=1, max_size=6),
    "max_tokens": st.integers(1, 30),
    "shared": st.booleans(),
    "draft": st.booleans(),
})


def check_group_accounting(sched: Scheduler) -> None:
    """Per cache group: running sequences' tables cover their computed tokens with referenced
    blocks, every block's ref count is the number of tables holding it, and all groups' tables
    of a sequence are as long; the pool's large pages add up."""
    kv = sched.kv
    refs: list[dict[int, int]] = [{} for _ in kv.pools]
    for req in sched.running:
        tables = kv.block_tables(req.request_id)
        assert len({len(t) for t in tables}) == 1, (req.request_id, [len(t) for t in tables])
        for g, table in enumerate(tables):
            assert len(table) * kv.block_size >= req.num_computed_tokens
            for b in table:
                assert not b.is_null and b.ref_cnt >= 1 and not kv.pools[g].is_free(b), (g, req.request_id, b)
                refs[g][b.block_id] = refs[g].get(b.block_id, 0) + 1
    for rid, req in sched.requests.items():
        if req.status != RequestStatus.RUNNING:
            assert not any(kv.block_tables(rid)), f"{rid} ({req.status}) still holds blocks"
    for g, pool in enumerate(kv.pools):
        for block in pool.blocks:
            if pool.pages.owner[block.block_id // pool.per_page] == g and not block.is_null:
                assert block.ref_cnt == refs[g].get(block.block_id, 0), (g, block)
    u = kv.usage()
    assert u.total == u.free + u.cached + u.used, u


def verified_hashes(requests: list[Request], bs: int) -> set[bytes]:
    """Every chained block hash of every request's verified tokens (prompt and outputs)."""
    out: set[bytes] = set()
    for r in requests:
        hashes: list[bytes] = []
        extend_block_hashes(hashes, r.all_token_ids, bs, root_hash("m", None))
        out.update(hashes)
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(w=workload_st)
def test_rollback_keeps_the_pool_consistent_and_the_index_verified(w):
    rng = random.Random(w["seed"])
    bs, k = w["block_size"], w["k"]
    layout = single_group_layout(FullAttentionSpec(bs, 2, 1, 1))
    if w["draft"]:  # a draft group of the target's page size (pages of two sizes fragment: see the note)
        layout = with_draft_group(layout, 2, 1, 1, "float32")
    kv = KVCacheManager(layout, w["num_blocks"], "m", True, "lru")
    sched = Scheduler(SchedulerConfig(w["max_num_batched_tokens"], w["max_num_seqs"]), kv)
    head = [rng.randrange(VOCAB) for _ in range(30)]
    requests = []
    for i, n in enumerate(w["prompts"]):
        prompt = (head[:n] if w["shared"] else []) + [rng.randrange(VOCAB) for _ in range(n)]
        if len(prompt) + 1 > kv.capacity_tokens(w["max_num_batched_tokens"]):
            continue
        req = Request(f"r{i}", prompt, SamplingParams(max_tokens=w["max_tokens"], ignore_eos=True))
        sched.add_request(req)
        requests.append(req)
    verified_any = False
    for _ in range(2000):
        if not sched.has_unfinished():
            break
        for req in sched.running:  # random drafts for every decoding sequence
            req.draft_token_ids = [rng.randrange(VOCAB) for _ in range(rng.randint(0, k))]
        out = sched.schedule()
        sampled: dict[str, int | list[int]] = {}
        for s in out.seqs:
            for target in s.samplers:
                if s.draft_token_ids:  # accept a random prefix; the target's token differs from the next draft
                    d = s.draft_token_ids
                    a = rng.randint(0, len(d))
                    last = rng.randrange(VOCAB)
                    if a < len(d) and last == d[a]:
                        last = (last + 1) % VOCAB
                    sampled[target.request_id] = d[:a] + [last]
                    verified_any = True
                else:
                    sampled[target.request_id] = rng.randrange(VOCAB)
        spec = {s.request.request_id: (s.start, len(s.draft_token_ids)) for s in out.seqs if s.draft_token_ids}
        sched.update_from_output(out, sampled)
        if w["draft"]:
            check_group_accounting(sched)
        else:
            check_block_accounting(sched)
        for req in sched.running:
            held = len(kv.block_tables(req.request_id)[0])
            assert held * bs >= req.num_computed_tokens
            assert held <= -(-req.num_tokens // bs), (req.request_id, held, req.num_tokens)
            if req.request_id in spec:  # exactly what the verified tokens and the next one need
                start, d = spec[req.request_id]
                assert held == min(-(-req.num_tokens // bs), -(-(start + 1 + d) // bs))
                assert req.num_computed_tokens == req.num_tokens - 1
            assert not req.draft_token_ids  # consumed by the schedule
        verified = verified_hashes(requests, bs)
        for pool in kv.pools:
            assert set(pool.index.hashes()) <= verified, "an unverified token's block is in the prefix index"
    else:
        raise AssertionError("the workload did not finish")
    for req in requests:
        assert req.status == RequestStatus.FINISHED_LENGTH
        assert req.num_output_tokens <= w["max_tokens"]
        # all of them, unless the sequence outgrew the whole pool (finished by length there)
        assert req.num_output_tokens == w["max_tokens"] or len(req.all_token_ids) >= kv.capacity_tokens(
            w["max_num_batched_tokens"])
    if verified_any:
        assert kv.usage().used == 0
