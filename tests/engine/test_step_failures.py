"""An error in one request never stops the engine: a request whose own work fails (its text, on
the host) fails alone; a step that raises fails the requests it held; either way the others
produce transformers' greedy tokens, every block goes back to the pool, and later requests run.

The failures are real: a ``SamplingParams`` changed after the engine accepted it (so past its
validation) breaks the detokenizer (``skip_special_tokens=None``) or the sampler (``top_k="x"``)."""
from __future__ import annotations

import pytest
import torch

from kvos import SamplingParams
from tests.support.hf_reference import hf_greedy

PROMPT = "One, two, three,"


def run_all(engine) -> dict:
    finished = {}
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert not engine.has_unfinished_requests()
    return finished


def greedy(max_tokens: int = 8) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def test_a_request_failing_on_the_host_fails_alone(llm, hf_model, tokenizer):
    engine = llm.engine
    ids = tokenizer(PROMPT).input_ids
    bad = greedy()
    engine.add_request("The capital of France is", bad, request_id="host-bad")
    engine.add_request({"prompt_token_ids": ids}, greedy(), request_id="host-ok")
    bad.skip_special_tokens = None  # past validation: the detokenizer raises on its first token
    outs = run_all(engine)

    failed = outs["host-bad"].outputs[0]
    assert failed.finish_reason == "error" and failed.failed
    assert failed.stop_reason.startswith("engine error: TypeError")
    ok = outs["host-ok"].outputs[0]  # in the same steps, untouched
    assert ok.finish_reason == "length" and ok.token_ids == hf_greedy(hf_model, ids, 8)[0]
    assert engine.kv.stats()["used"] == 0


def test_a_failing_step_fails_its_requests_and_the_engine_goes_on(llm, hf_model, tokenizer):
    engine = llm.engine
    before = engine.stats()["failed_steps"]
    bad = SamplingParams(temperature=0.8, seed=1, max_tokens=8)
    engine.add_request("The capital of France is", bad, request_id="step-bad")
    bad.top_k = "x"  # past validation: the sampler raises inside the step
    outs = run_all(engine)

    failed = outs["step-bad"].outputs[0]
    assert failed.finish_reason == "error" and failed.stop_reason.startswith("engine error: TypeError")
    assert engine.stats()["failed_steps"] == before + 1
    assert engine.kv.stats()["used"] == 0

    ids = tokenizer(PROMPT).input_ids  # the same engine serves the next request correctly
    out = llm.generate([{"prompt_token_ids": ids}], greedy(), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and out.token_ids == hf_greedy(hf_model, ids, 8)[0]


def test_a_failing_step_leaves_waiting_requests_to_run(make_llm, hf_model, tokenizer):
    """One sequence at a time with async scheduling: the failing step holds only its own request
    (and the step in flight, whose request it fails too); the requests still waiting then run."""
    llm = make_llm(max_num_seqs=1, async_scheduling=True)
    engine = llm.engine
    ids = tokenizer(PROMPT).input_ids
    bad = SamplingParams(temperature=0.8, seed=1, max_tokens=4)
    engine.add_request("The capital of France is", bad, request_id="first-bad")
    for i in range(2):
        engine.add_request({"prompt_token_ids": ids}, greedy(), request_id=f"waiting-{i}")
    bad.top_k = "x"
    outs = run_all(engine)

    assert outs["first-bad"].outputs[0].finish_reason == "error"
    ref = hf_greedy(hf_model, ids, 8)[0]
    for i in range(2):
        assert outs[f"waiting-{i}"].outputs[0].token_ids == ref
    assert engine.kv.stats()["used"] == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_failing_step_on_the_gpu_with_a_step_in_flight():
    """On CUDA (async scheduling and graphs, the defaults) a step fails while the one before it
    is in flight: the requests of both end as errors, nothing leaks, and the engine then gives the
    same tokens it gave before the failure."""
    from kvos import LLM

    llm = LLM(model="llama-tiny", random_weights=True, device="cuda", dtype="float32", num_blocks=120,
              max_num_seqs=16)
    engine = llm.engine
    assert engine.async_scheduling
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(3, 500, (n,), generator=g).tolist()} for n in (7, 40, 130)]
    ref = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(12), use_tqdm=False)]

    for i, p in enumerate(prompts):
        engine.add_request(p, greedy(12), request_id=f"run-{i}")
    for _ in range(3):  # prefill, then decodes: one step in flight behind each call
        engine.step()
    bad = SamplingParams(temperature=0.8, seed=1, max_tokens=4)
    engine.add_request(prompts[0], bad, request_id="gpu-bad")
    bad.top_k = "x"
    outs = run_all(engine)
    assert outs["gpu-bad"].outputs[0].finish_reason == "error"
    assert engine.stats()["failed_steps"] == 1
    for i in range(3):
        c = outs[f"run-{i}"].outputs[0]
        assert c.finish_reason == "error" or c.token_ids == ref[i]
        assert c.token_ids == ref[i][:len(c.token_ids)]
    assert engine.kv.stats()["used"] == 0
    again = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(12), use_tqdm=False)]
    assert again == ref
