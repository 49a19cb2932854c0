"""Random-weight models from the bundled configs (the GPU benchmark's models), on the CPU:
the transformers model sharing kvos's weights generates the same greedy tokens."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvos import LLM, SamplingParams
from kvos.models.hf_bridge import hf_model_sharing_weights
from kvos.models.loader import bundled_configs


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


def test_qwen3_shape_matches_transformers(tmp_path):
    """Qwen3's per-head q/k norms, from a config.json path."""
    import json

    cfg = json.loads((Path(__file__).parents[2] / "kvos/models/configs/qwen3-8b.json").read_text())
    cfg.update(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=64, vocab_size=1024)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    llm = LLM(model=str(tmp_path / "config.json"), random_weights=True, num_blocks=32)
    hf = hf_model_sharing_weights(llm.engine.runner.model)
    p = list(range(5, 45))
    out = llm.generate([{"prompt_token_ids": p}], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                       use_tqdm=False)[0]
    with torch.inference_mode():
        ref = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                          max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    assert out.outputs[0].token_ids == ref[0, len(p):].tolist()


def test_same_seed_same_weights_in_every_dtype():
    from kvos.models.loader import load_model, resolve_config_path

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
