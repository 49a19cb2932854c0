"""Draft-model speculation on the real model (CPU): a separate draft file whose KV is a cache
group of its own in the pool, and a self-draft of the target's first layers that shares the
target's KV. Greedy outputs equal plain decoding's under every pressure the cache applies. With
the target's own weights as the draft file, the draft agrees with the target on (nearly) every
token, which holds only while the draft's group holds the right K/V for every verified token:
after prefix hits, chunked prefill, forks (n > 1) and preemption by recompute and by swap."""
from __future__ import annotations

import pytest

from kvos import SamplingParams
from kvos.cache.spec import FullAttentionSpec
from kvos.models.loader import default_model_path
from tests.support.speculative import CODE, FREE, QUOTE, plain_tokens, tokens

DRAFT = {"method": "draft_model", "model": str(default_model_path()), "num_speculative_tokens": 4}
SELF = {"method": "self_draft", "num_draft_layers": 20, "num_speculative_tokens": 3}
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
SAME_WEIGHTS_ACCEPTANCE = 0.9
"""The draft file is the target's: only batch-shape numerics can make them disagree (float32)."""


@pytest.fixture(scope="module")
def draft_llm(make_llm):
    return make_llm(kv_cache_memory_bytes=64 << 20, speculative_config=DRAFT)


def acceptance_since(eng, before: tuple[int, int]) -> float:
    s = eng.engine.spec_stats
    proposed, accepted = s.proposed - before[0], s.accepted - before[1]
    assert proposed > 0
    return accepted / proposed


def counts(eng) -> tuple[int, int]:
    return eng.engine.spec_stats.proposed, eng.engine.spec_stats.accepted


def test_a_draft_file_keeps_its_kv_in_a_group_of_its_own(llm, draft_llm):
    prompts = [QUOTE, CODE, FREE]
    before = counts(draft_llm)
    assert tokens(draft_llm.generate(prompts, GREEDY, use_tqdm=False)) == plain_tokens(llm, prompts, GREEDY)
    assert acceptance_since(draft_llm, before) >= SAME_WEIGHTS_ACCEPTANCE
    groups = draft_llm.engine.stats()["groups"]
    assert [g["role"] for g in groups] == ["model", "draft"]
    cfg = draft_llm.engine.runner.draft.cfg  # the draft's geometry, by the cache's one formula
    expected = FullAttentionSpec(16, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, "float32").page_bytes
    assert groups[1]["page_bytes"] == expected == 16 * 2 * 30 * 3 * 64 * 4
    assert groups[1]["cached"] > 0  # the draft's blocks are registered beside the target's
    hits = draft_llm.engine.kv.counters.prefix_hits_tokens
    before = counts(draft_llm)
    assert tokens(draft_llm.generate([QUOTE], GREEDY, use_tqdm=False)) == plain_tokens(llm, [QUOTE], GREEDY)[:1]
    assert draft_llm.engine.kv.counters.prefix_hits_tokens > hits  # both groups hit
    assert acceptance_since(draft_llm, before) >= SAME_WEIGHTS_ACCEPTANCE


@pytest.mark.parametrize("case", ["chunked_prefill_n2", "recompute", "swap"])
def test_the_draft_s_kv_stays_right_under_the_cache_s_pressures(llm, make_llm, case):
    kw = {"speculative_config": DRAFT, "kv_cache_memory_bytes": 64 << 20}
    params, prompts = GREEDY, [QUOTE, CODE]
    if case == "chunked_prefill_n2":
        kw["max_num_batched_tokens"] = 24
        params = SamplingParams(temperature=0, max_tokens=GREEDY.max_tokens, ignore_eos=True, n=2)
    else:  # a pool too small for all four at once: some are preempted
        kw.update(num_blocks=48, block_size=8, preemption_mode=case, swap_space_gb=0.05)
        prompts = [QUOTE, CODE, QUOTE + " the", CODE + "    "]
    eng = make_llm(**kw)
    assert tokens(eng.generate(prompts, params, use_tqdm=False)) == plain_tokens(llm, prompts, params)
    assert acceptance_since(eng, (0, 0)) >= SAME_WEIGHTS_ACCEPTANCE
    if case != "chunked_prefill_n2":
        assert eng.engine.kv.counters.preemptions > 0
    if case == "swap":
        assert eng.engine.kv.counters.swapped_out_blocks > 0


def test_seeded_sampling_with_a_draft_model_reproduces(draft_llm):
    sp = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=16, ignore_eos=True)
    a = tokens(draft_llm.generate([QUOTE], sp, use_tqdm=False))
    b = tokens(draft_llm.generate([QUOTE, FREE], [sp, SamplingParams(temperature=1.0, max_tokens=10)],
                                  use_tqdm=False))
    assert a[0] == b[0]


def test_a_self_draft_shares_the_target_s_kv(llm, make_llm):
    eng = make_llm(speculative_config=SELF, num_blocks=24, block_size=8, preemption_mode="swap",
                   swap_space_gb=0.05, max_num_batched_tokens=24)
    prompts = [QUOTE, CODE, QUOTE + " the", CODE + "    "]
    assert tokens(eng.generate(prompts, GREEDY, use_tqdm=False)) == plain_tokens(llm, prompts, GREEDY)
    assert [g["role"] for g in eng.engine.stats()["groups"]] == ["model"]  # no KV of its own
    assert eng.engine.kv.counters.preemptions > 0
    assert eng.engine.spec_stats.accepted > 0


def test_draft_configs_are_checked_before_the_engine_starts(make_llm):
    with pytest.raises(ValueError, match="speculative_config.num_draft_layers .30. must be fewer"):
        make_llm(speculative_config={"method": "self_draft", "num_draft_layers": 30})
    with pytest.raises(ValueError, match="speculative_config.model: .*does not exist"):
        make_llm(speculative_config={"method": "draft_model", "model": "/nonexistent/draft.gguf"})
    with pytest.raises(ValueError, match="speculative_config.model names the draft model"):
        make_llm(speculative_config={"method": "draft_model"})
    with pytest.raises(ValueError, match="speculative_config.num_draft_layers: required"):
        make_llm(speculative_config={"method": "self_draft"})
