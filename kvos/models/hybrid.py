"""Models with Mamba2 layers: Bamba (``BambaForCausalLM``), Granite 4.0-H
(``GraniteMoeHybridForCausalLM``: Mamba2 and attention layers, each followed by a shared MLP
plus, when configured, a top-k mixture of experts) and pure Mamba2 (``Mamba2ForCausalLM``).

Attention layers use paged KV like the Llama family (RoPE over the first ``rotary_fraction`` of
each head, or none: Granite 4.0-H); Mamba layers read and write paged recurrent state
(``kvos.models.state``). Parameter names follow transformers' checkpoints.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from kvos.models import ops
from kvos.models.attention import AttentionBackend, AttentionMetadata, KVCache
from kvos.models.config import ModelConfig
from kvos.models.llama import MLP, RMSNorm, put, take_weight
from kvos.models.mamba import Mamba2Mixer


class PartialRotary:
    """RoPE (``rotate_half`` layout) over the first ``rotary_dim`` dimensions of each head, the
    rest passed through (transformers' ``partial_rotary_factor``); float32 tables."""

    def __init__(self, cfg: ModelConfig, device: torch.device | str) -> None:
        self.dim = int(cfg.head_dim * cfg.rotary_fraction)
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, self.dim, 2, dtype=torch.int64).float() / self.dim))
        freqs = torch.outer(torch.arange(cfg.max_position_embeddings, dtype=torch.int64).float(), inv)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos, self.sin = emb.cos().to(device), emb.sin().to(device)
        self.full = self.dim == cfg.head_dim

    def __call__(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        if self.full:
            return ops.rotary(positions, q, k, self.cos, self.sin)
        d = self.dim
        qr, kr = ops.rotary_reference(positions, q[..., :d], k[..., :d], self.cos, self.sin)
        return torch.cat([qr, q[..., d:]], dim=-1), torch.cat([kr, k[..., d:]], dim=-1)


class HybridAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = self.nh * self.hd, self.nkv * self.hd
        self.qkv_proj = ops.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = ops.Linear(self.q_size, cfg.hidden_size, bias=cfg.qkv_bias)
        self.scale = cfg.attn_scale

    def forward(self, x, positions, rope: PartialRotary | None, cache: KVCache, meta: AttentionMetadata,
                backend: AttentionBackend) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k, v = q.view(-1, self.nh, self.hd), k.view(-1, self.nkv, self.hd), v.view(-1, self.nkv, self.hd)
        if rope is not None:
            q, k = rope(positions, q, k)
        return self.o_proj(backend.forward(q, k, v, cache, meta, self.scale).reshape(-1, self.q_size))


class Experts(nn.Module):
    """Granite's top-k mixture: a router, then per expert ``down(silu(gate) * up)`` weighted by the
    softmax of the chosen experts' router logits."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
        self.top_k = cfg.num_experts_per_tok
        self.router = nn.Parameter(torch.empty(e, h))
        self.input_linear = nn.Parameter(torch.empty(e, 2 * i, h))
        self.output_linear = nn.Parameter(torch.empty(e, h, i))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.router).float()
        top, idx = logits.topk(self.top_k, dim=-1)
        weights = torch.softmax(top, dim=-1).to(x.dtype)
        out = torch.zeros_like(x)
        for e in idx.unique().tolist():
            rows, slot = torch.where(idx == e)
            gate, up = F.linear(x[rows], self.input_linear[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.output_linear[e]) * weights[rows, slot, None]
            out.index_add_(0, rows, y)
        return out


class HybridLayer(nn.Module):
    """``x + m * mixer(norm(x))`` then, unless pure Mamba2, ``x + m * mlp(norm(x))`` (``m``:
    Granite's residual multiplier, else 1)."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.is_mamba = layer in cfg.mamba_layers
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if self.is_mamba:
            assert cfg.mamba is not None
            self.mixer: nn.Module = Mamba2Mixer(cfg.hidden_size, cfg.mamba)
        else:
            self.mixer = HybridAttention(cfg)
        self.mult = cfg.residual_multiplier
        self.mlp: nn.Module | None = None
        self.experts: Experts | None = None
        if cfg.arch != "mamba2":
            self.post_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            width = cfg.shared_intermediate_size if cfg.arch == "granitemoehybrid" else cfg.intermediate_size
            self.mlp = MLP(_with_intermediate(cfg, width))
            if cfg.num_experts:
                self.experts = Experts(cfg)

    def forward(self, x, positions, rope, cache, meta, backend):
        h = self.input_layernorm(x)
        h = self.mixer(h, cache, meta) if self.is_mamba else self.mixer(h, positions, rope, cache, meta, backend)
        x = x + h * self.mult if self.mult != 1.0 else x + h
        if self.mlp is None:
            return x
        h = self.post_layernorm(x)
        out = self.mlp(h)
        if self.experts is not None:
            out = self.experts(h) + out
        return x + out * self.mult if self.mult != 1.0 else x + out


def _with_intermediate(cfg: ModelConfig, width: int) -> ModelConfig:
    return replace(cfg, intermediate_size=width)


class HybridForCausalLM(nn.Module):
    """The interface of ``LlamaForCausalLM``: ``forward`` over a step's flat tokens, where layer i
    reads ``kv_caches[i]`` / ``metas[i]`` (paged KV and ``AttentionMetadata`` for attention
    layers, ``StateCache`` and ``StateMetadata`` for Mamba layers); ``compute_logits`` on the rows
    that are sampled."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(HybridLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = ops.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope: PartialRotary | None = None

    def setup_rope(self, device: torch.device | str) -> None:
        if self.cfg.rotary_fraction > 0 and self.cfg.attention_layers:
            self.rope = PartialRotary(self.cfg, device)

    def layer_rotary(self, layer: int):
        raise ValueError("segment reuse is not supported for models with Mamba layers")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: Sequence,
                metas: Sequence, backend: AttentionBackend, num_layers: int | None = None) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.cfg.embedding_multiplier != 1.0:
            x = x * self.cfg.embedding_multiplier
        for i, layer in enumerate(self.layers[:num_layers] if num_layers is not None else self.layers):
            x = layer(x, positions, self.rope, kv_caches[i], metas[i], backend)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        return logits / self.cfg.logits_scaling if self.cfg.logits_scaling != 1.0 else logits

    def load_hf_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Load a transformers checkpoint of ``cfg.arch``, fusing q/k/v and gate/up. Raises
        ValueError naming a missing or misshapen tensor."""
        cfg = self.cfg

        def load(param: torch.Tensor, name: str) -> None:
            put(param, take_weight(weights, name), name)

        pure = cfg.arch == "mamba2"
        root = "backbone." if pure else "model."
        load(self.embed_tokens.weight, root + ("embeddings.weight" if pure else "embed_tokens.weight"))
        load(self.norm.weight, root + {"mamba2": "norm_f", "bamba": "final_layernorm"}.get(cfg.arch, "norm")
             + ".weight")
        if cfg.tie_word_embeddings or "lm_head.weight" not in weights:
            self.lm_head.weight = self.embed_tokens.weight
        else:
            load(self.lm_head.weight, "lm_head.weight")
        for i, layer in enumerate(self.layers):
            p = f"{root}layers.{i}."
            load(layer.input_layernorm.weight, p + ("norm.weight" if pure else "input_layernorm.weight"))
            if layer.is_mamba:
                m, mp = layer.mixer, p + ("mixer." if pure else "mamba.")
                for name in ("in_proj.weight", "conv1d.weight", "dt_bias", "A_log", "D", "norm.weight",
                             "out_proj.weight"):
                    load(m.get_parameter(name), mp + name)
                for name in ("in_proj.bias", "conv1d.bias", "out_proj.bias"):
                    if _has(m, name):
                        load(m.get_parameter(name), mp + name)
            else:
                a, ap = layer.mixer, p + "self_attn."
                put(a.qkv_proj.weight, torch.cat([take_weight(weights, ap + f"{x}_proj.weight") for x in "qkv"]),
                    ap + "qkv_proj.weight")
                if a.qkv_proj.bias is not None:
                    put(a.qkv_proj.bias, torch.cat([take_weight(weights, ap + f"{x}_proj.bias") for x in "qkv"]),
                        ap + "qkv_proj.bias")
                    load(a.o_proj.bias, ap + "o_proj.bias")
                load(a.o_proj.weight, ap + "o_proj.weight")
            if pure:
                continue
            if cfg.arch == "bamba":
                load(layer.post_layernorm.weight, p + "pre_ff_layernorm.weight")
                put(layer.mlp.gate_up_proj.weight, torch.cat([take_weight(weights, p + "feed_forward.gate_proj.weight"),
                                                              take_weight(weights, p + "feed_forward.up_proj.weight")]),
                    p + "feed_forward.gate_up_proj.weight")
                load(layer.mlp.down_proj.weight, p + "feed_forward.down_proj.weight")
            else:
                load(layer.post_layernorm.weight, p + "post_attention_layernorm.weight")
                load(layer.mlp.gate_up_proj.weight, p + "shared_mlp.input_linear.weight")
                load(layer.mlp.down_proj.weight, p + "shared_mlp.output_linear.weight")
                if layer.experts is not None:
                    load(layer.experts.router, p + "block_sparse_moe.router.layer.weight")
                    load(layer.experts.input_linear, p + "block_sparse_moe.input_linear.weight")
                    load(layer.experts.output_linear, p + "block_sparse_moe.output_linear.weight")


def _has(module: nn.Module, name: str) -> bool:
    try:
        return module.get_parameter(name) is not None
    except AttributeError:
        return False
