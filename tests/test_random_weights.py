"""Random-weight models from the bundled configs (the GPU benchmark's models), on the CPU:
the transformers model sharing kvos's weights generates the same greedy tokens."""
from __future__ import annotations

import pytest
import torch

from kvos import LLM, SamplingParams
from kvos.model.hf_bridge import hf_model_sharing_weights
from kvos.model.loader import bundled_configs


@pytest.fixture(scope="module")
def tiny():
    return LLM(model="llama-tiny", random_weights=True, num_blocks=128, max_num_batched_tokens=48)


def test_bundled_configs_include_benchmark_shapes():
    assert {"llama-3.1-8b", "qwen3-8b", "llama-tiny"} <= set(bundled_configs())


def test_greedy_matches_transformers_sharing_weights(tiny):
    hf = hf_model_sharing_weights(tiny.engine.runner.model)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 4096, (n,), generator=g).tolist() for n in (3, 30, 100)]
    outs = tiny.generate([{"prompt_token_ids": p} for p in prompts],
                         SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    for p, o in zip(prompts, outs):
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0)
        assert o.outputs[0].token_ids == ref[0, len(p):].tolist()
        assert o.outputs[0].text == ""  # no tokenizer: token ids only


def test_same_seed_same_weights_in_every_dtype():
    from kvos.model.loader import load_model, resolve_config_path

    path = resolve_config_path("llama-tiny")
    a = load_model(path, torch.float32, torch.device("cpu"), True)[1]
    b = load_model(path, torch.bfloat16, torch.device("cpu"), True)[1]
    wa, wb = a.layers[0].mlp.down_proj.weight, b.layers[0].mlp.down_proj.weight
    assert torch.equal(wa.to(torch.bfloat16), wb)


def test_text_prompt_without_tokenizer_is_rejected(tiny):
    with pytest.raises(ValueError, match="prompt_token_ids"):
        tiny.generate("hello", use_tqdm=False)
    with pytest.raises(ValueError, match="bundled config"):
        LLM(model="no-such-config", random_weights=True)
