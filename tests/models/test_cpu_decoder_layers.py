"""The default model's decode steps through one C call for all layers
(``kvos.kernels.cpu.decoder_layers``) against the per-operation Python path on the same engine:
the same greedy tokens and top log-probabilities within 1e-4 (SiLU's exp is the C library's
there and torch's here), batched decodes of different lengths, and the C path really taken.
(``tests/models/test_hf_parity.py`` holds the same path against transformers.)"""
from __future__ import annotations

from kvos import SamplingParams
from kvos.kernels.cpu import decoder_layers
from kvos.models.llama import LlamaForCausalLM


def _run(llm):
    llm.reset_prefix_cache()
    prompts = [{"prompt_token_ids": list(range(200 + 11 * i, 200 + 11 * i + n))} for i, n in enumerate((40, 97, 13))]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)
    return llm.generate(prompts, sp, use_tqdm=False)


def test_one_call_for_all_layers_matches_the_python_path(llm, monkeypatch):
    calls = []
    run = decoder_layers.DecodeLayers.run
    monkeypatch.setattr(decoder_layers.DecodeLayers, "run", lambda self, *a: calls.append(a[0].shape[0]) or run(self, *a))
    fused = _run(llm)
    assert calls and max(calls) == 3 and len(calls) >= 23  # the decode steps of three sequences
    monkeypatch.setattr(LlamaForCausalLM, "_cpu_decode", lambda *a: None)
    python = _run(llm)
    for a, b in zip(fused, python):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert x.keys() == y.keys()
            assert all(abs(x[t] - y[t]) < 1e-4 for t in x)
