"""Property test of speculative decoding's rollback in the scheduler and the KV memory system
(pure Python): random drafts, a random number of them accepted each step, small pools that
force preemption. After every step the pool adds up, each sequence holds no block past its
tokens (blocks of rejected drafts went back), and every hash in the prefix index is the hash
of tokens that were verified (the requests' own tokens), never of a rejected draft."""
from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvos.cache import FullAttentionSpec, KVCacheManager
from kvos.cache.hashing import extend_block_hashes, root_hash
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
})


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
    kv = KVCacheManager(FullAttentionSpec(bs, 1, 1, 1), w["num_blocks"], "m", True, "lru")
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
        cached = set(kv.pool.index.hashes())
        assert cached <= verified_hashes(requests, bs), "an unverified token's block is in the prefix index"
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
