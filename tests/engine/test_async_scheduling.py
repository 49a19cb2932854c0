"""Async scheduling (step N+1 scheduled and queued while step N runs): same outputs as the
synchronous loop, no step past a length limit, one dropped step past a stop token.

On the CPU the device work is synchronous, so these tests check the bookkeeping (pending
tokens, inputs fed from the previous step's samples, delayed outputs); ``tests/worker/test_gpu.py``
runs the same comparison on CUDA, where the steps really overlap."""
from __future__ import annotations

import random

import pytest

from kvos import LLM, SamplingParams

pytestmark = pytest.mark.slow


def tiny(async_on: bool, **kw) -> LLM:
    return LLM(model="llama-tiny", random_weights=True, async_scheduling=async_on, **kw)


def mixed_workload(seed: int = 0):
    """24 requests sharing a few prefixes, with greedy and seeded sampling, logprobs, n=2
    and assorted lengths."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 4000) for _ in range(48)] for _ in range(3)]
    prompts, params = [], []
    for i in range(24):
        tail = [rng.randrange(3, 4000) for _ in range(rng.randrange(1, 150))]
        prompts.append({"prompt_token_ids": prefixes[i % 3] + tail})
        params.append(SamplingParams(temperature=0 if i % 3 else 0.8, seed=i, max_tokens=rng.randrange(1, 40),
                                     logprobs=(i % 4) or None, n=2 if i % 5 == 0 else 1))
    return prompts, params


def stop_midway(params: list[SamplingParams], free_outs) -> None:
    """Give odd requests a stop token: the one their unstopped run produced midway."""
    for p, o in zip(params[1::2], free_outs[1::2]):
        toks = o.outputs[0].token_ids
        p.stop_token_ids = [toks[len(toks) // 2]] if len(toks) > 2 else []


def summary(outs) -> list:
    """Tokens, finish and stop reasons of every completion (logprobs: ``logprobs_of``)."""
    return [[(c.token_ids, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outs]


def logprobs_of(outs) -> list[float]:
    return [lp[t] for o in outs for c in o.outputs if c.logprobs for lp, t in zip(c.logprobs, c.token_ids)]


def test_async_outputs_match_sync_under_preemption_prefix_hits_and_forks():
    prompts, params = mixed_workload()
    stop_midway(params, tiny(False, num_blocks=60, max_num_batched_tokens=256, max_num_seqs=16).generate(
        prompts, params, use_tqdm=False))
    runs = {}
    for async_on in (False, True):
        llm = tiny(async_on, num_blocks=60, max_num_batched_tokens=256, max_num_seqs=16)
        assert llm.engine.async_scheduling is async_on
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.stats()
        assert stats["preemptions"] > 0 and stats["prefix_hits_tokens"] > 0, stats
        assert stats["used"] == 0  # every block released
        runs[async_on] = (summary(outs), logprobs_of(outs))
    assert runs[True][0] == runs[False][0]
    # batches differ between the modes (a stopped sequence's extra step), so fp32 sums differ
    assert runs[True][1] == pytest.approx(runs[False][1], abs=1e-3)
    assert any(c[1] == "stop" for o in runs[True][0] for c in o)  # stop tokens were hit
    assert any(len(o) == 2 for o in runs[True][0])


def scheduled_steps(llm, prompts, params) -> tuple[list, dict[str, int]]:
    """Outputs, and how many steps scheduled each request (``req-i`` in submission order)."""
    counts: dict[str, int] = {}

    def hook(out):
        for s in out.seqs:
            counts[s.request.request_id] = counts.get(s.request.request_id, 0) + 1

    llm.engine.schedule_hook = hook
    outs = llm.generate(prompts, params, use_tqdm=False)
    llm.engine.schedule_hook = None
    return outs, counts


def test_no_step_past_max_tokens_and_one_dropped_step_past_a_stop_token():
    prompt = {"prompt_token_ids": list(range(10, 60))}
    free = tiny(False).generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                                use_tqdm=False)[0].outputs[0].token_ids
    k = next(i for i in range(2, len(free)) if free[i] not in free[:i])  # first new token after two
    stop_tok = free[k]
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop_token_ids=[stop_tok])]
    results = {}
    for async_on in (False, True):
        llm = tiny(async_on)
        outs, counts = scheduled_steps(llm, [prompt, prompt], params)
        results[async_on] = (summary(outs), sorted(counts.values()))
    assert results[True][0] == results[False][0]
    assert results[False][0][1][0][0] == free[: k + 1]  # stopped on the stop token
    # sync: 1 prefill + 5 decodes, and 1 + k; async: the length limit is known when scheduling,
    # the stop token only after the next step was queued (its token is dropped)
    assert results[False][1] == sorted([6, k + 1])
    assert results[True][1] == sorted([6, k + 2])


def test_abort_while_a_step_is_in_flight_frees_everything():
    llm = tiny(True)
    eng = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    keep = eng.add_request({"prompt_token_ids": list(range(5, 40))}, sp)
    drop = eng.add_request({"prompt_token_ids": list(range(50, 90))}, sp)
    for _ in range(4):
        eng.step()
    assert eng._in_flight is not None
    eng.abort_request(drop)
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    assert set(done) == {keep}
    ref = tiny(False).generate([{"prompt_token_ids": list(range(5, 40))}], sp, use_tqdm=False)[0]
    assert done[keep].outputs[0].token_ids == ref.outputs[0].token_ids
    assert llm.stats()["used"] == 0


def test_async_with_a_cpu_tier_and_stop_strings_matches_sync(make_llm):
    """The default model: chat turns through a small pool, so later turns load from the CPU
    tier, then a stop string, which the engine detects only after the next step was queued."""
    from tests.connector.test_tiers import (
        chat_turns,  # (imports redis, absent where tests/worker/test_gpu.py runs)
    )

    runs = {}
    for async_on in (False, True):
        llm = make_llm(async_scheduling=async_on, num_blocks=24, cpu_cache_gb=0.05)
        outs = chat_turns(llm, evict=True)
        stop = llm.generate(["Count: 1, 2, 3,"], SamplingParams(temperature=0, max_tokens=16, stop=" 5"),
                            use_tqdm=False)[0].outputs[0]
        assert llm.stats()["tier_hits_tokens"] > 0
        runs[async_on] = ([o.outputs[0].token_ids for o in outs], stop.text, stop.finish_reason)
    assert runs[True] == runs[False]
    assert runs[True][2] == "stop"


def test_async_with_swap_preemption_matches_sync(make_llm):
    prompts = [f"Write a long story about the number {i}. Once upon a time" for i in range(6)]
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    runs = {}
    for async_on in (False, True):
        llm = make_llm(async_scheduling=async_on, num_blocks=20, preemption_mode="swap")
        outs = llm.generate(prompts, sp, use_tqdm=False)
        assert llm.stats()["swapped_out_blocks"] > 0, llm.stats()
        runs[async_on] = [o.outputs[0].token_ids for o in outs]
    assert runs[True] == runs[False]
