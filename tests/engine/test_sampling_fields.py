"""Issue #16's sampling fields in the engine: presence/frequency/repetition penalties, logit
bias and min_tokens' stop-token ban, checked against a plain per-row reference."""
from __future__ import annotations

import random

import pytest
import torch

from kvos import SamplingParams
from kvos.worker.sampler import Sampler, SampleRow, adjust_logits


def reference(logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int],
              ban: list[int] | None = None) -> torch.Tensor:
    """One row, one token at a time: bias, ban, repetition, frequency, presence."""
    x = logits.clone()
    for t, b in (params.logit_bias or {}).items():
        x[t] += b
    for t in ban or []:
        x[t] = float("-inf")
    p = params.repetition_penalty
    if p != 1.0:
        for t in set(prompt) | set(output):
            x[t] = x[t] / p if x[t] > 0 else x[t] * p
    for t in set(output):
        x[t] -= params.frequency_penalty * output.count(t) + params.presence_penalty
    return x


def test_batched_adjustment_equals_the_per_row_reference():
    rng = random.Random(0)
    V, R = 300, 7
    logits = torch.randn(R + 2, V, generator=torch.Generator().manual_seed(0)) * 3
    prev = torch.tensor([11, 42, 7])  # the previous launch's device tokens
    kinds = [dict(), dict(presence_penalty=1.5), dict(frequency_penalty=-0.7, presence_penalty=0.3),
             dict(repetition_penalty=1.8), dict(repetition_penalty=0.6, frequency_penalty=2.0),
             dict(logit_bias={3: 100, 5: -100, 299: 2.5}), dict(presence_penalty=-2, logit_bias={0: -5})]
    rows, expect, order = [], [], list(range(R + 2))
    rng.shuffle(order)
    for i, kw in enumerate(kinds):
        sp = SamplingParams(temperature=0, **kw)
        prompt = [rng.randrange(V) for _ in range(rng.randrange(1, 20))]
        output = [rng.randrange(V) for _ in range(rng.randrange(0, 30))] + [7, 7]
        pending = i % 3 if i % 2 else -1
        ban = [1, 2] if i in (2, 5) else None
        rows.append(SampleRow(order[i], sp, output_ids=output if sp.needs_history else None,
                              prompt_ids=prompt if sp.repetition_penalty != 1 else None,
                              pending_src=pending if sp.needs_history else -1, ban_ids=ban))
        full = output + ([int(prev[pending])] if pending >= 0 and sp.needs_history else [])
        expect.append(reference(logits[order[i]], sp, prompt, full, ban))
    got = adjust_logits(logits[[r.row for r in rows]], rows, prev)
    torch.testing.assert_close(got, torch.stack(expect), rtol=0, atol=1e-5)
    assert torch.equal(got[0], logits[order[0]])  # a row asking for nothing is untouched
    tokens = [s.token_id for s in Sampler()(logits, rows, prev)]
    assert tokens == [int(e.argmax()) for e in expect]


@pytest.fixture(scope="module")
def async_llm(make_llm):
    """The default model with async scheduling (the CPU default is off): the token sampled by
    the step in flight is not on the host yet, so the penalties read it on the device."""
    llm = make_llm(async_scheduling=True)
    assert llm.engine.async_scheduling
    return llm


@pytest.mark.parametrize("async_on", [False, True], ids=["sync", "async"])
def test_generated_tokens_follow_the_penalised_logits(request, async_on):
    """End to end: the engine's greedy choice at every step is the argmax of the reference
    applied to that step's raw logits and the tokens generated so far (async scheduling's
    pending token included); a plain request in the same batch is untouched, and min_tokens
    holds off a boosted EOS."""
    llm = request.getfixturevalue("async_llm" if async_on else "llm")
    pen = SamplingParams(temperature=0, max_tokens=10, presence_penalty=0.8, frequency_penalty=0.6,
                         repetition_penalty=1.3, logit_bias={11: -3.0})
    plain = SamplingParams(temperature=0, max_tokens=10)
    prompts = ["Repeat after me: cat cat cat cat cat cat cat cat", "Repeat after me: dog dog dog dog dog"]
    seen: dict[str, list[torch.Tensor]] = {}
    runner = llm.engine.runner
    runner.logits_hook = lambda ids, rows: [seen.setdefault(i, []).append(r.clone()) for i, r in zip(ids, rows)]
    try:
        outs = llm.generate(prompts, [pen, plain], use_tqdm=False)
    finally:
        runner.logits_hook = None
    a, b = outs
    ra, rb = seen[a.request_id], seen[b.request_id]
    out_a, out_b = a.outputs[0].token_ids, b.outputs[0].token_ids
    assert len(ra) == len(out_a) and len(rb) == len(out_b)
    for k, tok in enumerate(out_a):
        assert int(reference(ra[k].float(), pen, a.prompt_token_ids, out_a[:k]).argmax()) == tok
    assert [int(r.argmax()) for r in rb] == out_b
    assert len(set(out_a)) > len(set(out_b))  # the penalties break the repetition
    eos = llm.get_tokenizer().eos_token_id
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8, min_tokens=5,
                                                                    logit_bias={eos: 100}), use_tqdm=False)
    ids = out[0].outputs[0].token_ids
    assert len(ids) == 5 and ids[-1] == eos and eos not in ids[:-1]


def test_neutral_values_take_the_plain_path(llm):
    prompts = ["The capital of France is", "def fibonacci(n):"]
    base = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8),
                                                           use_tqdm=False)]
    neutral = SamplingParams(temperature=0, max_tokens=8, presence_penalty=0.0, frequency_penalty=0.0,
                             repetition_penalty=1.0, logit_bias={})
    assert not neutral.adjusts_logits
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, neutral, use_tqdm=False)] == base


def test_logit_bias_and_min_tokens(llm, tokenizer):
    prompt = "The capital of France is"
    base = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0].outputs[0]
    banned = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4,
                                                   logit_bias={base.token_ids[0]: -100}), use_tqdm=False)[0]
    assert banned.outputs[0].token_ids[0] != base.token_ids[0]
    forced = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=3, logit_bias={42: 100}),
                          use_tqdm=False)[0]
    assert forced.outputs[0].token_ids == [42, 42, 42]
    # min_tokens: EOS (and stop_token_ids) cannot be sampled before it
    eos = tokenizer.eos_token_id
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, min_tokens=6, logit_bias={eos: 100}),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 6 and out.token_ids[-1] == eos and eos not in out.token_ids[:-1]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, min_tokens=3, logit_bias={42: 100},
                                                stop_token_ids=[42]), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 3 and out.token_ids[-1] == 42 and out.finish_reason == "stop"


@pytest.mark.parametrize("kw, field", [
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(repetition_penalty=0), "repetition_penalty"), (dict(repetition_penalty="x"), "repetition_penalty"),
    (dict(logit_bias={1: 101}), "logit_bias"), (dict(logit_bias={"a": 1}), "logit_bias"),
    (dict(logit_bias=[1]), "logit_bias"), (dict(min_tokens=-1), "min_tokens"),
])
def test_invalid_values_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)


def test_logit_bias_outside_the_vocabulary(llm):
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate(["hi"], SamplingParams(logit_bias={10**7: 1.0}), use_tqdm=False)
    assert llm.generate(["hi"], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids
