"""``SamplingParams(prompt_logprobs=k)``: every prompt token's logprob given the tokens before it
(and the top k), computed on the runner during chunked prefill, against transformers on the
same GGUF (fp32, CPU)."""
from __future__ import annotations

import pytest
import torch

from kvos import SamplingParams
from tests.support.prompts import LONG_DOC

PROMPT = "Summarise the following report.\n\n" + LONG_DOC[:1200] + "\n\nSummary:"
K = 5
ATOL = 1e-3


@pytest.fixture(scope="module")
def engines(make_llm):
    """Prefill chunks of 64 tokens (so a ~300-token prompt crosses chunk boundaries), sync and
    async scheduling."""
    kw = {"max_num_batched_tokens": 64, "kv_cache_memory_bytes": 64 << 20}
    return make_llm(**kw), make_llm(**kw, async_scheduling=True)


@pytest.fixture(scope="module")
def reference(tokenizer, hf_model):
    ids = tokenizer(PROMPT).input_ids
    with torch.inference_mode():
        logits = hf_model(input_ids=torch.tensor([ids])).logits[0].float()
    return ids, torch.log_softmax(logits, dim=-1)


def check_against_reference(plps, ids, ref) -> None:
    assert len(plps) == len(ids) and plps[0] is None
    for i in range(1, len(ids)):
        row, lp = plps[i], ref[i - 1]
        assert next(iter(row)) == ids[i]  # the prompt token first, then the top k
        assert abs(row[ids[i]] - lp[ids[i]].item()) <= ATOL, f"position {i}"
        top_vals, top_ids = lp.topk(K)
        assert len(row) == K + (ids[i] not in top_ids.tolist())
        ours = sorted((v for t, v in row.items() if t != ids[i] or t in top_ids.tolist()), reverse=True)
        assert len(ours) == K
        for t, v in row.items():  # each of our entries is the token's true logprob
            assert abs(v - lp[t].item()) <= ATOL, f"position {i} token {t}"
        # and they are the top k: ours match transformers' top-k values rank by rank
        assert max(abs(a - b) for a, b in zip(ours, top_vals.tolist())) <= ATOL, f"position {i}"


def test_prompt_logprobs_match_transformers_under_chunked_prefill(engines, reference):
    ids, ref = reference
    assert 250 <= len(ids) <= 400
    llm = engines[0]
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=K),
                       use_tqdm=False)[0]
    check_against_reference(out.prompt_logprobs, ids, ref)
    assert out.outputs[0].token_ids[0] == int(ref[-1].argmax())

    # the same prompt again would be a prefix hit: it computes every position instead, with
    # identical results; a request without prompt logprobs still hits the blocks it left cached
    again = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=K),
                         use_tqdm=False)[0]
    assert again.num_cached_tokens == 0
    assert again.prompt_logprobs == out.prompt_logprobs
    plain = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
    assert plain.num_cached_tokens >= len(ids) - 16 and plain.prompt_logprobs is None
    assert plain.outputs[0].token_ids == out.outputs[0].token_ids


def test_prompt_logprobs_in_a_mixed_batch_with_async_scheduling(engines, reference):
    """Async scheduling, beside a request without prompt logprobs and one with k = 0 and n = 2."""
    ids, ref = reference
    llm = engines[1]
    short = ids[:40]
    outs = llm.generate([{"prompt_token_ids": short}, {"prompt_token_ids": ids}, {"prompt_token_ids": ids}],
                        [SamplingParams(temperature=0, max_tokens=3),
                         SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=K),
                         SamplingParams(temperature=0.8, seed=1, n=2, max_tokens=3, prompt_logprobs=0)],
                        use_tqdm=False)
    assert outs[0].prompt_logprobs is None and len(outs[0].outputs[0].token_ids) == 3
    check_against_reference(outs[1].prompt_logprobs, ids, ref)
    zero = outs[2].prompt_logprobs
    assert len(zero) == len(ids) and zero[0] is None and len(outs[2].outputs) == 2
    for i in range(1, len(ids)):
        assert list(zero[i]) == [ids[i]]
        assert abs(zero[i][ids[i]] - outs[1].prompt_logprobs[i][ids[i]]) <= 1e-4  # other chunk shapes


@pytest.mark.parametrize("bad", [-1, 1.5, "2", True])
def test_prompt_logprobs_validation(bad):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=bad)


def test_prompt_logprobs_none_and_zero_are_valid():
    assert SamplingParams().prompt_logprobs is None
    assert SamplingParams(prompt_logprobs=0).prompt_logprobs == 0
