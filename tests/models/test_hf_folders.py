"""Models from HF folders (config.json + safetensors): the default model re-saved, and small
random Llama-3 / Qwen2 / Qwen3 models checked against transformers on the same weights."""
from __future__ import annotations

import json

import pytest
import torch

from kvos import SamplingParams
from tests.support.hf_reference import hf_greedy

PROMPT = "The capital of France is"


def test_default_model_as_hf_folder_gives_the_same_tokens(tmp_path, hf_model, tokenizer, llm, make_llm):
    from safetensors.torch import save_file

    config = hf_model.config.to_dict()
    config.pop("quantization_config", None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    weights = {k: v.clone() for k, v in hf_model.state_dict().items() if k != "lm_head.weight"}
    save_file(weights, str(tmp_path / "model.safetensors"))
    tokenizer.save_pretrained(tmp_path)
    folder_llm = make_llm(model=str(tmp_path))
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ours = folder_llm.generate([PROMPT], sp, use_tqdm=False)[0]
    ref = llm.generate([PROMPT], sp, use_tqdm=False)[0]
    assert ours.outputs[0].token_ids == ref.outputs[0].token_ids
    assert ours.outputs[0].text == ref.outputs[0].text


def tiny(arch: str):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                  tie_word_embeddings=False, eos_token_id=2, bos_token_id=1)
    if arch == "llama3":
        return LlamaConfig(**common, rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256})
    if arch == "qwen2":
        return Qwen2Config(**common, rope_theta=1000000.0)
    return Qwen3Config(**common, head_dim=32, rope_theta=1000000.0)


@pytest.mark.parametrize("arch", ["llama3", "qwen2", "qwen3"])
def test_random_small_models_match_transformers(arch, tmp_path, tokenizer, make_llm):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny(arch), dtype=torch.float32).eval()
    with torch.no_grad():  # larger weights than the default init (logits far from ties); non-trivial
        for name, p in model.named_parameters():  # biases and norm weights, so loading them is tested
            if p.dim() == 2:
                p.normal_(0, 0.2)
            elif "bias" in name:
                p.normal_(0, 0.5)
            else:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    llm = make_llm(model=str(tmp_path), block_size=4)
    prompt_ids = tokenizer("The quick brown fox jumps over the lazy dog. " * 12).input_ids
    captured: list[torch.Tensor] = []
    llm.engine.runner.logits_hook = lambda ids, logits: captured.extend(logits.clone())
    out = llm.generate([{"prompt_token_ids": prompt_ids}],
                       SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    ref_tokens, ref_logits = hf_greedy(model, prompt_ids, 12)
    assert out.outputs[0].token_ids == ref_tokens
    for a, b in zip(captured, ref_logits):
        assert (a - b).abs().max().item() <= 1e-3 * b.abs().max().item()
