"""A transformers model that shares a kvos model's weights (no copy): the side-by-side baseline
and the correctness reference for models whose weights exist only inside kvos (random weights)."""
from __future__ import annotations

import torch

from kvos.model.config import ModelConfig
from kvos.model.llama import LlamaForCausalLM

HF_CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
              "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}


def hf_config(cfg: ModelConfig):
    import transformers

    config_cls = getattr(transformers, HF_CLASSES[cfg.arch][0])
    kw = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
              num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
              num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
              max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=cfg.tie_word_embeddings,
              rope_theta=cfg.rope_theta, rope_scaling=cfg.rope_scaling,
              bos_token_id=cfg.bos_token_id, eos_token_id=(cfg.eos_token_ids or [None])[0])
    if cfg.arch == "llama":
        kw["attention_bias"] = cfg.qkv_bias
    return config_cls(**kw)


def hf_state_dict(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """HF-named views into kvos's fused parameters."""
    cfg = model.cfg
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    sd = {"model.embed_tokens.weight": model.embed_tokens.weight, "model.norm.weight": model.norm.weight,
          "lm_head.weight": model.lm_head.weight}
    for i, layer in enumerate(model.layers):
        p, a = f"model.layers.{i}.", layer.self_attn
        for name, part in zip("qkv", a.qkv_proj.weight.split([q, kv, kv])):
            sd[p + f"self_attn.{name}_proj.weight"] = part
        if a.qkv_proj.bias is not None:
            for name, part in zip("qkv", a.qkv_proj.bias.split([q, kv, kv])):
                sd[p + f"self_attn.{name}_proj.bias"] = part
        sd[p + "self_attn.o_proj.weight"] = a.o_proj.weight
        if a.q_norm is not None:
            sd[p + "self_attn.q_norm.weight"] = a.q_norm.weight
            sd[p + "self_attn.k_norm.weight"] = a.k_norm.weight
        gate, up = layer.mlp.gate_up_proj.weight.chunk(2)
        sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"] = gate, up
        sd[p + "mlp.down_proj.weight"] = layer.mlp.down_proj.weight
        sd[p + "input_layernorm.weight"] = layer.input_layernorm.weight
        sd[p + "post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight
    return sd


def hf_model_sharing_weights(model: LlamaForCausalLM, attn_implementation: str = "sdpa"):
    """The transformers model of the same architecture whose parameters alias ``model``'s."""
    import transformers

    cfg = model.cfg
    hf_cls = getattr(transformers, HF_CLASSES[cfg.arch][1])
    config = hf_config(cfg)
    config._attn_implementation = attn_implementation
    weight = model.embed_tokens.weight
    with torch.device("meta"):
        hf = hf_cls(config).to(weight.dtype)
    hf.load_state_dict(hf_state_dict(model), strict=False, assign=True)
    if cfg.tie_word_embeddings:
        hf.tie_weights()
    with torch.device(weight.device):  # rotary tables are computed from the config, not loaded
        hf.model.rotary_emb = type(hf.model.rotary_emb)(config=config)
    leftover = [n for n, t in list(hf.named_parameters()) + list(hf.named_buffers()) if t.is_meta]
    if leftover:
        raise ValueError(f"hf bridge: {leftover[:3]} have no kvos counterpart")
    return hf.eval()
