"""Invariant 1: the cache never changes the answer (greedy, fp32, CPU)."""
from __future__ import annotations

import pytest

from kvos import SamplingParams
from tests.support.prompts import LONG_DOC

pytestmark = pytest.mark.slow

SHARED = "You are a careful assistant. Answer briefly and precisely.\n\n" + LONG_DOC[:800] + "\n\n"
PROMPTS = [SHARED + q for q in ("Question: what does the fox do?", "Question: where do the leaves go?",
                                 "Question: who records the items?")] + [
    "The capital of France is", "def quicksort(xs):", "Once upon a time,"]
# 8 tokens: every prompt still decodes across a block boundary at block_size=1 and most at 16/32, and
# the shared prefix (~200 tokens) still spans several blocks of 32 (each engine step costs ~0.4 s).
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(llm):
    llm.reset_prefix_cache()
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


def tokens(llm) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


@pytest.mark.parametrize("kwargs", [
    dict(enable_prefix_caching=False),
    dict(block_size=1),
    dict(block_size=32),
    dict(max_num_batched_tokens=16),
    dict(max_num_batched_tokens=8192),
    dict(max_num_seqs=1),
], ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_same_tokens_under_cache_settings(make_llm, reference, kwargs):
    llm = make_llm(**kwargs)
    assert tokens(llm) == reference
    assert tokens(llm) == reference  # second pass: served from the warm prefix cache
    if kwargs.get("enable_prefix_caching", True):
        assert llm.stats()["prefix_hits_tokens"] > 0
    usage = llm.stats()
    assert usage["used"] == 0 and usage["free"] + usage["cached"] == usage["total"]


def test_same_tokens_with_preemption(make_llm, reference, tokenizer):
    longest = max(len(tokenizer(p).input_ids) for p in PROMPTS) + PARAMS.max_tokens
    # room for the longest request and a little more: the others must preempt each other
    llm = make_llm(num_blocks=longest // 16 + 6, block_size=16)
    assert tokens(llm) == reference
    stats = llm.stats()
    assert stats["preemptions"] > 0
    assert stats["recomputed_tokens"] > 0
    assert stats["used"] == 0


def test_same_tokens_alone_and_in_a_batch(llm, reference):
    alone = [llm.generate([p], PARAMS, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]
    assert alone == reference


def test_same_tokens_with_swap_preemption(make_llm, reference, tokenizer):
    longest = max(len(tokenizer(p).input_ids) for p in PROMPTS) + PARAMS.max_tokens
    llm = make_llm(num_blocks=longest // 16 + 6, block_size=16, preemption_mode="swap")
    assert tokens(llm) == reference
    stats = llm.stats()
    assert stats["preemptions"] > 0
    assert stats["swapped_in_blocks"] == stats["swapped_out_blocks"] > 0
    assert stats["recomputed_tokens"] == 0  # everything came back from host memory
    assert stats["used"] == 0 and llm.engine.scheduler.swapper.used_bytes == 0
