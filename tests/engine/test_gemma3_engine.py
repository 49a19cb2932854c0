"""Gemma 3 270M, a hybrid model (15 sliding-window layers of window 512, 3 full-attention layers),
in the engine on the CPU in fp32, against transformers' Gemma 3 on the engine's own weights
(``hf_model_sharing_weights``; tests/models/test_gemma3_model.py holds those weights and the
config against transformers' own load of the GGUF): greedy tokens identical
and per-step logits within 1e-3 of the largest, on prompts shorter than and about three times
the window, whatever the KV layout, block size, prefix caching, prefill chunking, preemption and
n = 2 forking (the layouts and block sizes on prompts of up to two windows)."""
from __future__ import annotations

import pytest
import torch

from kvos import LLM, SamplingParams
from tests.support.hf_reference import greedy_with_logits, hf_greedy
from tests.support.prompts import LONG_DOC

pytestmark = pytest.mark.slow

NEW_TOKENS = 12
KV_BYTES = 128 << 20
WINDOW = 512


@pytest.fixture(scope="module")
def base(gemma_path):
    return LLM(model=str(gemma_path), kv_cache_memory_bytes=KV_BYTES)


@pytest.fixture(scope="module")
def prompt_ids(base):
    tok = base.get_tokenizer()
    texts = ["The capital of France is", "Once upon a time, in a small village by the sea,",
             "Summarise the following report.\n\n" + LONG_DOC + "\n\nSummary:",
             "Continue the ledger.\n\n" + LONG_DOC[: len(LONG_DOC) // 2] + "\n\nNext item:"]
    ids = [tok(t).input_ids for t in texts]
    assert ids[0][0] == tok.bos_token_id
    assert len(ids[0]) < 16 and len(ids[2]) > 3 * WINDOW and WINDOW < len(ids[3]) < 2 * WINDOW, [len(i) for i in ids]
    return ids


@pytest.fixture(scope="module")
def reference(base, prompt_ids):
    from kvos.models.hf_bridge import hf_model_sharing_weights

    hf = hf_model_sharing_weights(base.engine.runner.model).eval()
    return [hf_greedy(hf, ids, NEW_TOKENS) for ids in prompt_ids]


def run(llm: LLM, prompt_ids, n: int = 1):
    return greedy_with_logits(llm, prompt_ids, NEW_TOKENS, n)


def test_greedy_tokens_and_logits_match_transformers(base, prompt_ids, reference):
    assert len(base.engine.layout.groups) == 2  # full attention (3 layers) + sliding window (15)
    outs, logits = run(base, prompt_ids)
    for o, (ref_tokens, ref_logits) in zip(outs, reference):
        assert o.outputs[0].token_ids == ref_tokens
        ours = logits[o.request_id]
        assert len(ours) == NEW_TOKENS
        for step, (a, b) in enumerate(zip(ours, ref_logits)):
            err, tol = (a - b).abs().max().item(), 1e-3 * b.abs().max().item()
            assert err <= tol, f"step {step} of a {len(o.prompt_token_ids)}-token prompt: {err:.2e} > {tol:.2e}"
    assert base.stats()["used"] == 0


@pytest.mark.parametrize("options", [
    dict(block_size=32),
    dict(enable_prefix_caching=False),
    dict(max_num_batched_tokens=96),  # chunked prefill across the window
    dict(max_num_batched_tokens=256, num_blocks=80),  # too small for all at once: preemption
    dict(kv_layout="equal_pages"),
    dict(kv_layout="homogeneous"),
], ids=["block32", "no-prefix-caching", "chunked", "preemption", "equal-pages", "homogeneous"])
def test_cache_never_changes_the_answer(gemma_path, prompt_ids, reference, options):
    # the three-window prompt (the slowest to prefill on the CPU) where the scheduling changes:
    # chunks and preemption; the layouts and block sizes on prompts of up to two windows
    keep = range(4) if "max_num_batched_tokens" in options else (0, 1, 3)
    prompts, expected = [prompt_ids[i] for i in keep], [reference[i][0] for i in keep]
    llm = LLM(model=str(gemma_path), **{"kv_cache_memory_bytes": KV_BYTES, **options})
    passes = 2 if llm.engine.kv.enable_caching and "num_blocks" not in options else 1
    for attempt in range(passes):  # the second pass hits the cache (preempted runs hit within the first)
        outs, _ = run(llm, prompts)
        assert [o.outputs[0].token_ids for o in outs] == expected, (options, attempt)
    stats = llm.stats()
    if "num_blocks" in options:
        assert stats["preemptions"] > 0
    if llm.engine.kv.enable_caching:
        assert stats["prefix_hits_tokens"] > 0
    assert stats["used"] == 0


def test_n2_forks_share_the_prompt(base, prompt_ids, reference):
    outs, _ = run(base, prompt_ids[2:], n=2)
    for o, (ref_tokens, _) in zip(outs, reference[2:]):
        assert [c.token_ids for c in o.outputs] == [ref_tokens, ref_tokens]


def test_sliding_group_holds_only_the_window(gemma_path, prompt_ids):
    """While the longest prompt (more than three windows) decodes, its sliding-window table holds the
    window's blocks (plus the block being filled), not the whole context."""
    llm = LLM(model=str(gemma_path), kv_cache_memory_bytes=KV_BYTES, max_num_batched_tokens=128)
    bs = llm.engine.layout.block_size
    held: list[tuple[int, int, int]] = []

    def hook(out) -> None:
        for s in out.seqs:
            full, sliding = llm.engine.kv.block_tables(s.request.request_id)
            held.append((s.start, sum(not b.is_null for b in full), sum(not b.is_null for b in sliding)))

    llm.engine.schedule_hook = hook
    llm.generate([{"prompt_token_ids": prompt_ids[2]}], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    start, full, sliding = held[-1]
    assert full == -(-(start + 1) // bs)
    assert sliding <= -(-(WINDOW - 1) // bs) + 2 < full / 2, held[-1]
    assert max(s for _, _, s in held) <= -(-(WINDOW - 1 + 128) // bs) + 2
    stats = llm.stats()
    assert [g["kind"] for g in stats["groups"]] == ["full_attention", "sliding_window"]
    assert stats["used"] == 0


def test_segment_reuse_rotates_local_and_global_keys(gemma_path, base):
    """Segment reuse on Gemma 3: a document cached after BOS (the model's header) and reused
    after another prefix gives transformers' tokens and logits when transformers is fed the same
    KV rotated with each layer's own base (10,000 for the sliding layers, the global base for the
    full ones: ``tests/support/segment_reference.py``)."""
    from kvos.models.hf_bridge import hf_model_sharing_weights
    from tests.support.segment_reference import reused_segment_reference

    tok = base.get_tokenizer()
    bos = tok("").input_ids
    assert bos == [tok.bos_token_id]
    prefix = tok("Read the ledger below, then answer the question after it.\n").input_ids
    doc = tok(LONG_DOC, add_special_tokens=False).input_ids[:63]  # BOS + doc: four blocks of 16
    question = tok("\nQuestion: what is listed first? Answer:", add_special_tokens=False).input_ids
    hf = hf_model_sharing_weights(base.engine.runner.model).eval()
    ref_tokens, ref_logits = reused_segment_reference(hf, prefix, doc, question, NEW_TOKENS, header=bos)
    llm = LLM(model=str(gemma_path), kv_cache_memory_bytes=KV_BYTES, segment_reuse=True, segment_recompute=0.0)
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    llm.generate([{"prompt_token_ids": bos + doc}], greedy, use_tqdm=False)  # the source chain, cached
    rows: list[torch.Tensor] = []
    llm.engine.runner.logits_hook = lambda ids, logits: rows.append(logits[0].clone())
    a, b = len(prefix), len(prefix) + len(doc)
    out = llm.generate([{"prompt_token_ids": prefix + doc + question,
                         "segment_spans": [(0, a), (a, b), (b, b + len(question))]}], greedy, use_tqdm=False)[0]
    llm.engine.runner.logits_hook = None
    assert out.num_cached_tokens == len(doc)
    assert out.outputs[0].token_ids == ref_tokens
    assert (rows[0] - ref_logits).abs().max() < 1e-3 * ref_logits.abs().max()
