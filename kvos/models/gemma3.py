"""Gemma 3 text decoder with paged attention: five sliding-window layers to one full layer,
per-layer-type rotary bases, four norms per layer, per-head q/k norms, a GELU-tanh gated MLP,
scaled and tied embeddings. Parameter names follow HF (q/k/v and gate/up fused as in Llama).

Norm weights hold the effective ``1 + w`` of HF's ``Gemma3RMSNorm`` (computed in float32 when
loaded, as HF computes it per call) and stay float32 whatever the model's dtype
(``FP32_PARAMS``), so that a bfloat16 model normalises exactly like HF's."""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import nn

from kvos.models import ops
from kvos.models.attention import AttentionBackend, AttentionMetadata, KVCache
from kvos.models.config import ModelConfig
from kvos.models.llama import (
    MLP,
    RotaryEmbedding,
    load_shared_weights,
    put,
    take_weight,
)


class GemmaRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))  # 1 + w
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Normalise x (``[T, N]``, or ``[T, H, D]`` per head); with ``residual``, normalise
        ``x + residual`` and return it too."""
        return ops.gemma_rms_norm(x, self.weight, self.eps, residual)


def local_rope_config(cfg: ModelConfig) -> ModelConfig:
    """The config whose rotary table the sliding layers use: base ``rope_local_theta``, no scaling."""
    if cfg.rope_local_theta is None:
        return cfg
    return dataclasses.replace(cfg, rope_theta=cfg.rope_local_theta, rope_scaling=None)


class Gemma3Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.window = cfg.layer_window(layer)
        self.sliding = cfg.layer_types is not None and cfg.layer_types[layer] == "sliding_attention"
        self.nh, self.nkv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = self.nh * self.hd, self.nkv * self.hd
        self.qkv_proj = ops.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = ops.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = GemmaRMSNorm(self.hd, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.hd, cfg.rms_norm_eps)
        self.scale = cfg.attn_scale

    def forward(self, x, positions, rope: RotaryEmbedding, kv_cache: KVCache,
                meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.view(-1, self.nh, self.hd))
        k = self.k_norm(k.view(-1, self.nkv, self.hd))
        v = v.view(-1, self.nkv, self.hd)
        q, k = rope(positions, q, k)
        o = backend.forward(q, k, v, kv_cache, meta, self.scale, self.window)
        return self.o_proj(o.reshape(-1, self.q_size))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = Gemma3Attention(cfg, layer)
        self.mlp = MLP(cfg, ops.gelu_tanh_and_mul)
        eps = cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)

    def forward(self, x, residual, positions, rope, kv_cache, meta, backend):
        """The hidden state is ``x + residual`` (x alone for the first layer). Returns (this
        layer's normed MLP output, the residual stream before it); the next norm adds them, in
        HF's order: ``h = h + post_attention_norm(attn(input_norm(h)))``, then
        ``h = h + post_feedforward_norm(mlp(pre_feedforward_norm(h)))``."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, rope, kv_cache, meta, backend)
        x, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(x), residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class Gemma3ForCausalLM(nn.Module):
    """``forward`` takes the flat tokens of a step and returns hidden states; ``compute_logits``
    projects only the rows that are sampled (tied embeddings, no soft-capping)."""

    FP32_PARAMS = ("norm.weight",)
    """Parameter-name suffixes kept in float32 whatever the model's dtype (the loader casts the rest)."""
    RANDOM_NORM_STD = 0.1
    """Random-weight models draw norm weights ``1 + w`` with w ~ N(0, 0.1) clamped to +-0.4 (not
    all ones, so that a wrong norm shows), where ``(1 + w) - 1`` and back is exact in float32."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.layer_types is None or len(cfg.layer_types) != cfg.num_layers:
            raise ValueError("model: Gemma 3 needs layer_types for every layer")
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = ops.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope_global: RotaryEmbedding | None = None  # set by setup_rope on the model's device
        self.rope_local: RotaryEmbedding | None = None

    def setup_rope(self, device: torch.device | str) -> None:
        """Build both rotary tables on ``device``: full layers use ``rope_theta`` with
        ``rope_scaling``, sliding layers ``rope_local_theta`` without scaling."""
        self.rope_global = RotaryEmbedding(self.cfg, device)
        self.rope_local = RotaryEmbedding(local_rope_config(self.cfg), device)

    def layer_rotary(self, layer: int) -> RotaryEmbedding:
        """The rotary table layer ``layer``'s keys are rotated with: local for sliding layers."""
        rope = self.rope_local if self.layers[layer].self_attn.sliding else self.rope_global
        assert rope is not None, "setup_rope first"
        return rope

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: Sequence[KVCache],
                metas: Sequence[AttentionMetadata], backend: AttentionBackend,
                num_layers: int | None = None,
                media_embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Layer i writes and reads ``kv_caches[i]`` (its K and V, each ``[num_blocks,
        block_size, kv_heads, head_dim]``) through the block tables of ``metas[i]``.
        ``num_layers``: run only the first layers, then the final norm (a self-draft's early exit).
        ``media_embeds`` (rows, values ``[rows, hidden]``): those input rows take the given
        embeddings (an image's soft tokens) in place of their token's scaled embedding."""
        if media_embeds is not None:  # an image token id may lie past the text vocabulary (HF: pad id 0)
            input_ids = input_ids.masked_fill(input_ids >= self.cfg.vocab_size, 0)
        x = self.embed_tokens(input_ids)
        # HF: the float32 scalar sqrt(hidden) rounded to the model dtype, the product in that dtype
        x = x * torch.tensor(self.cfg.hidden_size ** 0.5, dtype=torch.float32).to(x.dtype)
        if media_embeds is not None:
            rows, values = media_embeds
            x = x.index_copy(0, rows, values.to(x.dtype))
        residual = None
        for i, layer in enumerate(self.layers[:num_layers] if num_layers is not None else self.layers):
            rope = self.rope_local if layer.self_attn.sliding else self.rope_global
            x, residual = layer(x, residual, positions, rope, kv_caches[i], metas[i], backend)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def load_hf_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Load HF-named tensors in HF's convention (norm weights ``w``, stored here as
        ``1.0 + w`` computed in float32), fusing q/k/v and gate/up. Raises ValueError on a
        missing or misshapen tensor, naming it."""
        def take(name: str) -> torch.Tensor:
            return take_weight(weights, name)

        def put_norm(norm: GemmaRMSNorm, name: str) -> None:
            put(norm.weight, 1.0 + take(name).float(), name)

        load_shared_weights(self, weights, put_norm)
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            put_norm(layer.self_attn.q_norm, p + "self_attn.q_norm.weight")
            put_norm(layer.self_attn.k_norm, p + "self_attn.k_norm.weight")
            for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                         "post_feedforward_layernorm"):
                put_norm(getattr(layer, norm), p + norm + ".weight")
