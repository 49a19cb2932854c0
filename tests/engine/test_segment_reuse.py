"""Segment reuse on the real default model: a segment cached alone is reused at another position
with its keys re-rotated, checked against transformers fed the same KV built with the rotation
written out here; 100% recompute is full prefill; tenants never share a segment; approximate
KV never enters the prefix cache."""
from __future__ import annotations

import pytest
import torch

from kvos import SamplingParams
from tests.support.segment_reference import reused_segment_reference

BS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=8)


@pytest.fixture(scope="module")
def texts(tokenizer):
    """A prefix, a document of 64 tokens (four blocks, the default model has no header) and a
    question, as token ids."""
    assert tokenizer("").input_ids == []
    prefix = tokenizer("Read the passage below, then answer.\n").input_ids
    doc = tokenizer(open("kvos/bench/data/macbeth_act1_scenes1-4.txt").read()[:2000]).input_ids[:4 * BS]
    question = tokenizer("\nQuestion: who is speaking in this passage? Answer:").input_ids
    assert len(prefix) % BS and len(doc) == 4 * BS
    return prefix, doc, question


def _run(llm, prompt, salt=None):
    rows = []
    llm.engine.runner.logits_hook = lambda ids, logits: rows.append(logits[0].clone())
    try:
        out = llm.generate([prompt], GREEDY, use_tqdm=False, cache_salt=salt)[0]
    finally:
        llm.engine.runner.logits_hook = None
    return out, rows[0]


def test_pure_reuse_equals_the_rotation_reference(make_llm, hf_model, texts):
    prefix, doc, question = texts
    ref_tokens, ref_logits = reused_segment_reference(hf_model, prefix, doc, question, GREEDY.max_tokens)
    for chunk in (2048, 24):  # one prefill step, and chunks that end inside and at the reused span
        llm = make_llm(segment_reuse=True, segment_recompute=0.0, max_num_batched_tokens=chunk)
        llm.generate([{"segments": [doc]}], GREEDY, use_tqdm=False)  # the document alone, at position 0
        out, logits = _run(llm, {"segments": [prefix, doc, question]})
        assert out.num_cached_tokens == len(doc)
        stats = llm.stats()
        assert stats["segment_hits"] == 1 and stats["segment_reused_tokens"] == len(doc)
        assert out.outputs[0].token_ids == ref_tokens
        assert (logits - ref_logits).abs().max() < 1e-3


def test_first_segment_header_equals_the_rotation_reference(make_llm, hf_model, tokenizer, texts):
    """segment_header="first_segment": the document is cached after the prompt's first segment
    (the instruction) and reused after another passage: its KV is the one computed after the
    instruction, rotated by the passage's length. The document's tail past its source's last
    full block is computed in place."""
    prefix, doc, question = texts
    other = tokenizer("A note that comes first in this prompt, before the passage itself.\n").input_ids
    n = (len(prefix) + len(doc)) // BS * BS - len(prefix)  # document tokens the source's full blocks hold
    ref_tokens, ref_logits = reused_segment_reference(hf_model, prefix + other, doc[:n], doc[n:] + question,
                                                      GREEDY.max_tokens, header=prefix)
    llm = make_llm(segment_reuse=True, segment_recompute=0.0, segment_header="first_segment")
    llm.generate([{"segments": [prefix, doc, question]}], GREEDY, use_tqdm=False)  # caches prefix + doc
    out, logits = _run(llm, {"segments": [prefix, other, doc, question]})
    assert out.num_cached_tokens == n + len(prefix) // BS * BS
    assert out.outputs[0].token_ids == ref_tokens
    assert (logits - ref_logits).abs().max() < 1e-3


def test_full_recompute_equals_full_prefill(make_llm, llm, texts):
    prefix, doc, question = texts
    exact = make_llm(segment_reuse=True, segment_recompute=1.0)
    exact.generate([{"segments": [doc]}], GREEDY, use_tqdm=False)
    out, logits = _run(exact, {"segments": [prefix, doc, question]})
    plain, plain_logits = _run(llm, {"prompt_token_ids": prefix + doc + question})
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids
    assert torch.equal(logits, plain_logits)
    assert out.num_cached_tokens == 0 and exact.stats()["segment_reused_tokens"] == 0


def test_recompute_share_and_exact_prefix_cache(make_llm, llm, texts):
    """15% recompute reuses the document's last 54 tokens; afterwards the same prompt sent plainly
    hits only the prefix's exact blocks, and answers as a fresh engine does."""
    prefix, doc, question = texts
    seg = make_llm(segment_reuse=True, segment_recompute=0.15)
    seg.generate([{"segments": [doc]}], GREEDY, use_tqdm=False)
    out, _ = _run(seg, {"segments": [prefix, doc, question]})
    head = -(-15 * len(doc) // 100)
    assert out.num_cached_tokens == len(doc) - head
    assert seg.stats()["segment_recomputed_tokens"] == head
    plain, _ = _run(seg, {"prompt_token_ids": prefix + doc + question})
    assert plain.num_cached_tokens == (len(prefix) + head) // BS * BS
    fresh, _ = _run(llm, {"prompt_token_ids": prefix + doc + question})
    assert plain.outputs[0].token_ids == fresh.outputs[0].token_ids


def test_a_segment_the_prefix_cache_served_in_part_reuses_the_rest(make_llm, texts):
    """The first request registers its exact blocks up to its first reused token, so the same
    prompt again hits into the document: the tokens past that hit are still reused (only the
    head's uncovered tokens computed), with the first request's KV and greedy tokens."""
    prefix, doc, question = texts
    seg = make_llm(segment_reuse=True, segment_recompute=0.15)
    seg.generate([{"segments": [doc]}], GREEDY, use_tqdm=False)
    first, first_logits = _run(seg, {"segments": [prefix, doc, question]})
    head = -(-15 * len(doc) // 100)
    hit = (len(prefix) + head) // BS * BS  # the exact blocks the first request registered
    assert len(prefix) < hit < len(prefix) + head  # the hit ends inside the document's head
    before = seg.stats()
    again, logits = _run(seg, {"segments": [prefix, doc, question]})
    stats = seg.stats()
    assert again.num_cached_tokens == hit + len(doc) - head  # the exact hit, then the reused rest
    assert stats["segment_hits"] - before["segment_hits"] == 1
    assert stats["segment_recomputed_tokens"] - before["segment_recomputed_tokens"] == len(prefix) + head - hit
    assert stats["segment_reused_tokens"] - before["segment_reused_tokens"] == len(doc) - head
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert (logits - first_logits).abs().max() < 1e-4
    # a plain prompt caches the document's first 40 tokens exactly, past its head: the segment
    # is then reused from the hit on, and the shared exact blocks are never written
    plain = prefix + doc[:40] + question
    ref, ref_logits = _run(seg, {"prompt_token_ids": plain})
    far = (len(prefix) + 40) // BS * BS
    assert far > len(prefix) + head
    before = seg.stats()
    out, _ = _run(seg, {"segments": [prefix, doc, question]})
    stats = seg.stats()
    assert out.num_cached_tokens == len(prefix) + len(doc)  # the exact hit to `far`, the rest reused
    assert stats["segment_recomputed_tokens"] == before["segment_recomputed_tokens"]
    assert stats["segment_reused_tokens"] - before["segment_reused_tokens"] == len(prefix) + len(doc) - far
    again, again_logits = _run(seg, {"prompt_token_ids": plain})
    assert again.num_cached_tokens >= far and torch.equal(again_logits, ref_logits)


def test_segments_never_cross_tenants(make_llm, texts):
    prefix, doc, question = texts
    seg = make_llm(segment_reuse=True, segment_recompute=0.0)
    seg.generate([{"segments": [doc]}], GREEDY, use_tqdm=False, cache_salt="tenant-a")
    other, _ = _run(seg, {"segments": [prefix, doc, question]}, salt="tenant-b")
    assert other.num_cached_tokens == 0 and seg.stats()["segment_hits"] == 0
    same, _ = _run(seg, {"segments": [prefix, doc, question]}, salt="tenant-a")
    assert same.num_cached_tokens == len(doc) and seg.stats()["segment_hits"] == 1


def test_unseen_segments_are_filled_and_answer_exactly(make_llm, llm, texts):
    """The first request with a document computes it exactly (and alone, to cache it); nothing
    is left referenced once everything finished."""
    prefix, doc, question = texts
    seg = make_llm(segment_reuse=True, segment_recompute=0.0)
    out, _ = _run(seg, {"segments": [prefix, doc, question]})
    fresh, _ = _run(llm, {"prompt_token_ids": prefix + doc + question})
    assert out.outputs[0].token_ids == fresh.outputs[0].token_ids
    stats = seg.stats()
    assert stats["segment_fills"] == 1 and stats["running"] == stats["waiting"] == 0
    assert stats["used"] == 0
    again, _ = _run(seg, {"segments": [question, doc, question]})  # the document elsewhere: reused
    assert again.num_cached_tokens == len(doc)


def test_bad_segments_name_the_field(llm):
    with pytest.raises(ValueError, match=r"segments\[1\]"):
        llm.generate([{"segments": ["a", 3]}], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="segments must be a non-empty list"):
        llm.generate([{"segments": []}], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="segment_spans"):
        llm.generate([{"prompt_token_ids": [1, 2, 3], "segment_spans": [[2, 1]]}], GREEDY, use_tqdm=False)
