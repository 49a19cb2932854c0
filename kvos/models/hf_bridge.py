"""A transformers model that shares a kvos model's weights (no copy): the side-by-side baseline
and the correctness reference for models whose weights exist only inside kvos (random weights).

Gemma 3's norm weights are the one exception: kvos stores ``1 + w`` where HF stores ``w``, so
those small vectors are copied (``weight - 1``, float32, exact for weights in [0.5, 2^24]); a later
change to kvos's norm weights is not seen by the HF model."""
from __future__ import annotations

import torch

from kvos.models.config import ModelConfig

HF_CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
              "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
              "mistral": ("MistralConfig", "MistralForCausalLM"),
              "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM")}


def hf_arch(cfg: ModelConfig) -> str:
    """The transformers family: a sliding-window "llama" config is Mistral (HF's Llama has no window)."""
    if cfg.arch == "llama" and cfg.sliding_window:
        if cfg.layer_types is not None and any(t != "sliding_attention" for t in cfg.layer_types):
            raise ValueError("hf bridge: a Llama-family model with mixed full/sliding layers has no "
                             "transformers counterpart here")
        return "mistral"
    return cfg.arch


def hf_config(cfg: ModelConfig):
    import transformers

    arch = hf_arch(cfg)
    config_cls = getattr(transformers, HF_CLASSES[arch][0])
    kw = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
              num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
              num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
              max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=cfg.tie_word_embeddings,
              rope_theta=cfg.rope_theta, rope_scaling=cfg.rope_scaling,
              bos_token_id=cfg.bos_token_id, eos_token_id=(cfg.eos_token_ids or [None])[0])
    if arch == "llama":
        kw["attention_bias"] = cfg.qkv_bias
    if arch == "mistral":
        kw["sliding_window"] = cfg.sliding_window
    if arch == "gemma3":
        # legacy rope keywords (both transformers 5.17 and 5.24 map them to rope_parameters):
        # rope_theta and rope_scaling for the full layers, rope_local_base_freq for the sliding ones
        qpas = cfg.query_pre_attn_scalar
        kw.update(rope_local_base_freq=cfg.rope_local_theta,
                  query_pre_attn_scalar=int(qpas) if float(qpas).is_integer() else qpas,
                  sliding_window=cfg.sliding_window, layer_types=list(cfg.layer_types),
                  hidden_activation="gelu_pytorch_tanh", final_logit_softcapping=None,
                  attn_logit_softcapping=None, attention_bias=False, pad_token_id=0)
    return config_cls(**kw)


def hf_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """HF-named views into kvos's fused parameters (Gemma's norms: copies holding ``w``)."""
    cfg = model.cfg
    gemma = cfg.arch == "gemma3"

    def norm(weight: torch.Tensor) -> torch.Tensor:
        return (weight.detach().float() - 1.0) if gemma else weight

    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    sd = {"model.embed_tokens.weight": model.embed_tokens.weight, "model.norm.weight": norm(model.norm.weight),
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
            sd[p + "self_attn.q_norm.weight"] = norm(a.q_norm.weight)
            sd[p + "self_attn.k_norm.weight"] = norm(a.k_norm.weight)
        gate, up = layer.mlp.gate_up_proj.weight.chunk(2)
        sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"] = gate, up
        sd[p + "mlp.down_proj.weight"] = layer.mlp.down_proj.weight
        norms = ["input_layernorm", "post_attention_layernorm"]
        if gemma:
            norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
        for n in norms:
            sd[p + n + ".weight"] = norm(getattr(layer, n).weight)
    return sd


def hf_model_sharing_weights(model: torch.nn.Module, attn_implementation: str = "sdpa"):
    """The transformers model of the same architecture whose parameters alias ``model``'s
    (Llama, Qwen2/3, Mistral with its sliding window, Gemma 3 text)."""
    import transformers

    cfg = model.cfg
    hf_cls = getattr(transformers, HF_CLASSES[hf_arch(cfg)][1])
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
    embed = hf.model.embed_tokens
    if hasattr(embed, "embed_scale"):  # Gemma's non-persistent float32 sqrt(hidden) buffer
        embed.embed_scale = torch.tensor(cfg.hidden_size ** 0.5, device=weight.device)
    leftover = [n for n, t in list(hf.named_parameters()) + list(hf.named_buffers()) if t.is_meta]
    if leftover:
        raise ValueError(f"hf bridge: {leftover[:3]} have no kvos counterpart")
    return hf.eval()
