"""Logprobs as vLLM's ``Logprob`` objects: ``.logprob``, ``.rank`` over the whole vocabulary and
``.decoded_token``, checked against transformers' log-softmax on the same sequence (the default
model, fp32, CPU); still floats, so code that treats them as numbers keeps working."""
from __future__ import annotations

import pickle

import torch

from kvos import SamplingParams
from kvos.core.outputs import Logprob

ATOL = 1e-3


def reference_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.log_softmax(hf_model(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)


def true_rank(row: torch.Tensor, token: int) -> int:
    return 1 + int((row > row[token]).sum())


def assert_rank_near(lp: Logprob, row: torch.Tensor, token: int) -> None:
    """The engine's rank against the reference's, up to tokens within ``ATOL`` of this one (two
    fp32 computations order near-ties differently)."""
    lo = 1 + int((row > row[token] + ATOL).sum())
    hi = int((row >= row[token] - ATOL).sum())
    assert lo <= lp.rank <= hi, (lp.rank, lo, hi, true_rank(row, token))


def test_sampled_and_prompt_logprobs_carry_rank_and_text(llm, tokenizer, hf_model):
    prompt = "The three primary colours are"
    ids = tokenizer(prompt).input_ids
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True, logprobs=4, prompt_logprobs=3)
    out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
    gen = out.outputs[0].token_ids
    ref = reference_logprobs(hf_model, ids + gen)

    far = 0
    for i, (tok, entry) in enumerate(zip(gen, out.outputs[0].logprobs)):
        row = ref[len(ids) - 1 + i]
        first = next(iter(entry))
        assert first == tok  # the sampled token first, then the top 4
        lp = entry[tok]
        assert isinstance(lp, Logprob) and isinstance(lp.logprob, float) and type(lp.logprob) is float
        assert abs(lp.logprob - row[tok].item()) <= ATOL and lp == lp.logprob
        assert_rank_near(lp, row, tok)
        far = max(far, lp.rank)
        assert sorted(v.rank for v in entry.values())[:4] == [1, 2, 3, 4]  # the top 4, ranked
        for t, v in entry.items():
            assert v.decoded_token == tokenizer.decode([t])
    assert far > 1  # sampling at temperature 1 left the top token at least once: ranks say where

    plps = out.prompt_logprobs
    assert plps[0] is None
    for pos in range(1, len(ids)):
        lp = plps[pos][ids[pos]]
        assert isinstance(lp, Logprob) and lp.decoded_token == tokenizer.decode([ids[pos]])
        assert_rank_near(lp, ref[pos - 1], ids[pos])
    assert max(plps[p][ids[p]].rank for p in range(1, len(ids))) > 3  # ranks beyond the listed top 3


def test_a_logprob_is_a_float_that_pickles_with_its_text():
    lp = Logprob(-0.25, 3, None, 42, lambda t: f"<{t}>")
    assert lp + 1 == 0.75 and sorted([lp, Logprob(-1.0)])[1] is lp
    back = pickle.loads(pickle.dumps(lp))
    assert (back.logprob, back.rank, back.decoded_token) == (-0.25, 3, "<42>")
    assert repr(back) == "Logprob(logprob=-0.25, rank=3, decoded_token='<42>')"
