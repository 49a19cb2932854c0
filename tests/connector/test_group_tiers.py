"""Tiers, swap and pins per cache group: the hybrid model (Gemma 3 270M, a full-attention and a
sliding-window group) and an FP8-KV engine restore prefixes from a CPU or disk tier with the
same greedy tokens as an engine without tiers; swap preemption and pins work on the hybrid."""
from __future__ import annotations

import pytest

from kvos import LLM, SamplingParams
from kvos.cache.tiers import group_key, group_tags
from tests.support.prompts import LONG_DOC

pytestmark = pytest.mark.slow

SP = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
KV_BYTES = 64 << 20
SYSTEM = "You are a careful assistant who answers questions about lighthouses and tides. " * 3
TURNS = [SYSTEM + "When is high tide?", SYSTEM + "When is high tide? And when is low tide today?"]


@pytest.fixture(scope="module")
def engines(gemma_path):
    """Per kind of engine: how to build it (its tiers added), and its tokens without tiers."""
    kinds = {"hybrid": {"model": str(gemma_path), "kv_cache_memory_bytes": KV_BYTES},
             "fp8": {"kv_cache_dtype": "fp8_e4m3", "num_blocks": 64}}
    return {k: (kw, [o.outputs[0].token_ids for o in turns(LLM(**kw, enable_prefix_caching=False), TURNS)])
            for k, kw in kinds.items()}


def turns(llm, prompts, reset: bool = False) -> list:
    """Each prompt's greedy output, one prompt after the other; with ``reset``, the device cache is dropped between
    turns (so a later turn's prefix can only come from a tier)."""
    out = []
    for p in prompts:
        o = llm.generate([p], SP, use_tqdm=False)[0]
        out.append(o)
        if reset:
            llm.reset_prefix_cache()
    return out


@pytest.mark.parametrize("tier", ["cpu", "disk"])
@pytest.mark.parametrize("kind", ["hybrid", "fp8"])
def test_later_turn_hits_the_tier_with_identical_tokens(kind, tier, engines, tmp_path):
    kw, reference = engines[kind]
    llm = LLM(**kw, **({"cpu_cache_gb": 0.05} if tier == "cpu" else {"disk_cache_dir": str(tmp_path)}))
    if kind == "hybrid":
        assert len(llm.engine.layout.groups) == 2
    outs = turns(llm, TURNS, reset=True)
    assert [o.outputs[0].token_ids for o in outs] == reference
    src = outs[1].metrics["cached_tokens_by_source"]
    assert src.get(tier, 0) >= 16 and src.get("device", 0) == 0, src
    assert outs[1].num_cached_tokens == sum(src.values())
    assert llm.stats()["used"] == 0


def test_tier_keys_bind_the_group():
    from kvos.cache.layout import build_layout

    unified = build_layout([512, None, 512], 16, 1, 8, "float32", "unified")
    equal = build_layout([512, None, 512], 16, 1, 8, "float32", "equal_pages")
    h = bytes(16)
    keys = [group_key(h, t) for t in group_tags(unified) + group_tags(equal)]
    assert len(set(keys)) == len(keys) and h not in keys  # no two groups (or layouts) share a key
    assert group_tags(build_layout([None, None], 16, 1, 8)) == [None]  # one group: the hash itself


def test_swap_preemption_on_the_hybrid_keeps_tokens(gemma_path):
    prompts = [f"Item {i}: " + LONG_DOC[i * 40: i * 40 + 160] for i in range(4)]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in LLM(model=str(gemma_path), kv_cache_memory_bytes=KV_BYTES)
           .generate(prompts, sp, use_tqdm=False)]
    llm = LLM(model=str(gemma_path), num_blocks=12, preemption_mode="swap", enable_prefix_caching=False)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    counters = llm.engine.kv.counters
    assert counters.preemptions > 0 and counters.swapped_out_blocks > 0 and counters.swapped_in_blocks > 0
    assert got == ref


def test_pin_on_the_hybrid_survives_a_reset_and_is_hit(gemma_path, engines):
    _, reference = engines["hybrid"]
    llm = LLM(model=str(gemma_path), kv_cache_memory_bytes=KV_BYTES)
    pin = llm.pin_prefix(SYSTEM)
    assert pin["pinned_tokens"] >= 32
    llm.reset_prefix_cache()  # drops every unpinned cached block
    out = llm.generate([TURNS[0]], SP, use_tqdm=False)[0]
    assert out.num_cached_tokens >= pin["pinned_tokens"]
    assert out.outputs[0].token_ids == reference[0]
    assert llm.unpin_prefix(pin["pin_id"])
    llm.reset_prefix_cache()
    assert llm.generate([TURNS[0]], SP, use_tqdm=False)[0].num_cached_tokens == 0


def test_a_prompt_past_the_window_loads_only_the_window_of_the_sliding_group(gemma_path, engines):
    """The sliding-window group restores only the blocks inside the window at the prefix's end
    (the prefix cache's rule); the full-attention group restores every block."""
    kw, _ = engines["hybrid"]
    doc = "Summarise the report.\n\n" + LONG_DOC[:3000]
    prompts = [doc, doc + "\n\nSummary in one line:"]
    reference = [o.outputs[0].token_ids for o in turns(LLM(**kw, enable_prefix_caching=False), prompts)]
    llm = LLM(**kw, cpu_cache_gb=0.5)
    assert len(llm.get_tokenizer()(doc).input_ids) > 512 + 3 * 16  # past the window of 512
    outs = turns(llm, prompts, reset=True)
    assert [o.outputs[0].token_ids for o in outs] == reference
    loaded = outs[1].metrics["cached_tokens_by_source"].get("cpu", 0) // 16
    window = -(-(512 - 1) // 16)
    assert loaded > window
    cpu = next(t for t in llm.stats()["tiers"] if t["name"] == "cpu")
    assert cpu["hits_blocks"] == loaded + window  # every full-attention block, the sliding window's
