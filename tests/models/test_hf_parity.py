"""Greedy output and per-step logits match HF transformers on the same GGUF (fp32, CPU)."""
from __future__ import annotations

import pytest

import torch

from kvos import SamplingParams
from tests.support.hf_reference import hf_greedy
from tests.support.prompts import PROMPTS

pytestmark = pytest.mark.slow

NEW_TOKENS = 16  # per prompt; 8+ prompts, one of over 1,000 tokens


def test_prompts_cover_a_long_one(tokenizer):
    lengths = [len(tokenizer(p).input_ids) for p in PROMPTS]
    assert len(PROMPTS) >= 8 and max(lengths) > 1000


def test_greedy_tokens_and_logits_match_transformers(llm, tokenizer, hf_model):
    captured: dict[str, list[torch.Tensor]] = {}

    def hook(ids, logits):
        for rid, row in zip(ids, logits):
            captured.setdefault(rid, []).append(row.clone())

    llm.engine.runner.logits_hook = hook
    try:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
                            use_tqdm=False)
    finally:
        llm.engine.runner.logits_hook = None

    for prompt, out in zip(PROMPTS, outs):
        ids = tokenizer(prompt).input_ids
        assert out.prompt_token_ids == ids
        ref_tokens, ref_logits = hf_greedy(hf_model, ids, NEW_TOKENS)
        assert out.outputs[0].token_ids == ref_tokens, prompt[:40]
        ours = captured[out.request_id]
        assert len(ours) == NEW_TOKENS
        for step, (a, b) in enumerate(zip(ours, ref_logits)):
            tol = 1e-3 * b.abs().max().item()
            err = (a - b).abs().max().item()
            assert err <= tol, f"step {step} of {prompt[:30]!r}: max |diff| {err:.2e} > {tol:.2e}"
