"""Llama-family decoder (Llama 2/3.x, SmolLM2, Mistral with its sliding window, Qwen2, Qwen3)
with paged attention. Parameter names follow HF so safetensors load as they are."""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from kvos.models import ops
from kvos.models.attention import AttentionBackend, AttentionMetadata, KVCache
from kvos.models.config import ModelConfig


def take_weight(weights: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """An HF-named tensor; ValueError naming it when missing."""
    if name not in weights:
        raise ValueError(f"model: weight {name!r} is missing")
    return weights[name]


def put(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
    """Copy ``value`` into ``param``; ValueError naming the weight when the shapes differ."""
    if tuple(param.shape) != tuple(value.shape):
        raise ValueError(f"model: weight {name!r} has shape {tuple(value.shape)}, "
                         f"expected {tuple(param.shape)}")
    param.data.copy_(value)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Normalise x over its last dimension (``[T, H, D]`` for Qwen3's per-head q/k norms, read
        in place from the fused projection); with ``residual``, normalise ``x + residual`` and
        return it too."""
        return ops.rms_norm(x, self.weight, self.eps, residual)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.int64).float() / cfg.head_dim))
    rs = cfg.rope_scaling
    if not rs:
        return inv
    kind = rs.get("rope_type", rs.get("type"))
    if kind == "linear":
        return inv / rs["factor"]
    if kind == "llama3":
        factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old = rs["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / low, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= old / high) & (wavelen <= old / low)
        return torch.where(is_mid, mid, scaled)
    raise ValueError(f"model: rope_scaling type {kind!r} is not supported")


class RotaryEmbedding:
    """Non-interleaved (HF ``rotate_half``) rotary embedding; the cos/sin table stays float32."""

    def __init__(self, cfg: ModelConfig, device: torch.device | str = "cpu") -> None:
        t = torch.arange(cfg.max_position_embeddings, dtype=torch.int64).float()
        freqs = torch.outer(t, rope_inv_freq(cfg))
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = emb.cos().to(device)
        self.sin = emb.sin().to(device)

    def __call__(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        return ops.rotary(positions, q, k, self.cos, self.sin)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.window = cfg.layer_window(layer)
        self.nh, self.nkv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = self.nh * self.hd, self.nkv * self.hd
        self.qkv_proj = ops.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = ops.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = self.hd ** -0.5

    def forward(self, x, positions, rope: RotaryEmbedding, kv_cache: KVCache,
                meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        q, k, v = self.project(x, positions, rope)
        o = backend.forward(q, k, v, kv_cache, meta, self.scale, self.window)
        return self.o_proj(o.reshape(-1, self.q_size))

    def project(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding):
        """q ``[T, H, D]``, k and v ``[T, KVH, D]`` of the normed input: the fused projection,
        Qwen3's per-head norms, RoPE on q and k."""
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.nh, self.hd)
        k = k.view(-1, self.nkv, self.hd)
        v = v.view(-1, self.nkv, self.hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope(positions, q, k)
        return q, k, v


class MLP(nn.Module):
    """Gated MLP: ``down(act_and_mul(gate_up(x)))`` (SiLU for Llama, GELU-tanh for Gemma)."""

    def __init__(self, cfg: ModelConfig, act_and_mul=ops.silu_and_mul) -> None:
        super().__init__()
        self.gate_up_proj = ops.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = ops.GatedLinear(cfg.intermediate_size, cfg.hidden_size, act_and_mul, bias=False)
        self.act_and_mul = act_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x))  # the activation is down_proj's (GatedLinear)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, positions, rope, kv_cache, meta, backend):
        """Returns (this layer's MLP output, the residual stream before it); the next norm adds them."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, rope, kv_cache, meta, backend)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    """``forward`` takes the flat tokens of a step and returns hidden states; ``compute_logits``
    projects only the rows that are sampled."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rope: RotaryEmbedding | None = None  # set by setup_rope on the model's device
        self.lm_head = ops.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def setup_rope(self, device: torch.device | str) -> None:
        """Build the rotary tables on ``device``; the loader calls it once the weights are there."""
        self.rope = RotaryEmbedding(self.cfg, device)

    def layer_rotary(self, layer: int) -> RotaryEmbedding:
        """The rotary table layer ``layer``'s keys are rotated with (one for every layer)."""
        assert self.rope is not None, "setup_rope first"
        return self.rope

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: Sequence[KVCache],
                metas: Sequence[AttentionMetadata], backend: AttentionBackend,
                num_layers: int | None = None,
                media_embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Layer i writes and reads ``kv_caches[i]`` (its K and V, each ``[num_blocks,
        block_size, kv_heads, head_dim]``) through the block tables of ``metas[i]`` (its cache
        group's metadata). ``num_layers``: run only the first layers, then the final norm (a
        self-draft's early exit). ``media_embeds`` (rows, values ``[rows, hidden]``): those input
        rows take the given embeddings (an image tile's soft tokens) in place of their token's."""
        if num_layers is None and media_embeds is None:
            fused = self._cpu_decode(input_ids, positions, kv_caches, metas, backend)
            if fused is not None:
                return fused
        x, residual = self.embed_tokens(input_ids), None
        if media_embeds is not None:
            rows, values = media_embeds
            x = x.index_copy(0, rows, values.to(x.dtype))
        for i, layer in enumerate(self.layers[:num_layers] if num_layers is not None else self.layers):
            x, residual = layer(x, residual, positions, self.rope, kv_caches[i], metas[i], backend)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def _cpu_decode(self, input_ids, positions, kv_caches, metas, backend) -> torch.Tensor | None:
        """The hidden states of a step of decodes from one C call over every layer
        (``kvos.kernels.cpu.decoder_layers``), or None where that path does not apply: not all
        rows decodes of one cache group, more rows than the block weights serve, or a model,
        backend or cache it does not cover (``_decode_layers``)."""
        m, meta = input_ids.shape[0], metas[0]
        if (input_ids.device.type != "cpu" or not backend.cpu_decode_kernel
                or not 0 < m <= ops.BLOCK_WEIGHT_ROWS or meta.num_decodes != m
                or any(other is not meta for other in metas)):
            return None
        layers = self._decode_layers(kv_caches)
        if layers is None:
            return None
        out, residual = layers.run(self.embed_tokens(input_ids), positions, meta.slot_mapping, meta.block_tables,
                                   meta.seq_lens, self.rope.cos, self.rope.sin)
        return self.norm(out, residual)[0]

    def _decode_layers(self, kv_caches: Sequence[KVCache]):
        """The C view of the layers and ``kv_caches`` (built once per cache set), or None when a
        layer is not the plain Llama one (q/k norms, biases, another activation, a subclass's
        layers, tensor-parallel shards and their hooks), a weight lacks its block form, the
        weights are not float32, or a cache is neither float32 laid out as the first nor an
        8-bit one that ``paged_kv8`` takes (all quantized or none)."""
        key = tuple((c.k.data_ptr(), c.v.data_ptr()) for c in kv_caches)
        cached = getattr(self, "_decode_layers_cache", None)
        if cached is not None and cached[0] == key:
            return cached[1]
        from kvos.kernels.cpu.build import library
        from kvos.kernels.cpu.decoder_layers import DecodeLayers
        from kvos.kernels.cpu.paged_kv8 import view_of

        cfg, built = self.cfg, None
        layers = []
        for i, layer in enumerate(self.layers):
            a, mlp, c = layer.self_attn, layer.mlp, kv_caches[i] if i < len(kv_caches) else None
            linears = (a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if (type(layer) is not DecoderLayer or type(a) is not Attention or type(mlp) is not MLP
                    or a.q_norm is not None or mlp.act_and_mul is not ops.silu_and_mul
                    or any(type(lin) not in (ops.Linear, ops.GatedLinear) or lin.blocks is None or lin.bias is not None
                           or lin._forward_hooks for lin in linears)
                    or c is None or c.quantized != kv_caches[0].quantized):
                break
            kv8 = view_of(*c) if c.quantized else None
            if (kv8 is None if c.quantized else
                    c.k.dtype != torch.float32 or c.k.stride() != c.v.stride()
                    or c.k.stride() != kv_caches[0].k.stride() or c.k.stride(-1) != 1):
                break
            layers.append((*(lin.blocks for lin in linears), layer.input_layernorm.weight.detach(),
                           layer.post_attention_layernorm.weight.detach(), c.k, c.v, a.window, kv8))
        else:
            if (library() is not None and type(self.embed_tokens) is nn.Embedding
                    and self.embed_tokens.weight.dtype == torch.float32
                    and cfg.head_dim % 8 == 0 and self.rope is not None):
                built = DecodeLayers(layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                     cfg.intermediate_size, cfg.rms_norm_eps, self.layers[0].self_attn.scale)
        self._decode_layers_cache = (key, built)
        return built

    def load_hf_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Load HF-named tensors, fusing q/k/v and gate/up. Raises ValueError on a missing or
        misshapen tensor, naming it."""
        def take(name: str) -> torch.Tensor:
            return take_weight(weights, name)

        load_shared_weights(self, weights, lambda norm, name: put(norm.weight, take(name), name))
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            a = layer.self_attn
            if a.q_norm is not None:
                put(a.q_norm.weight, take(p + "self_attn.q_norm.weight"), p + "self_attn.q_norm.weight")
                put(a.k_norm.weight, take(p + "self_attn.k_norm.weight"), p + "self_attn.k_norm.weight")
            put(layer.input_layernorm.weight, take(p + "input_layernorm.weight"), p + "input_layernorm.weight")
            put(layer.post_attention_layernorm.weight, take(p + "post_attention_layernorm.weight"),
                p + "post_attention_layernorm.weight")


def load_shared_weights(model: nn.Module, weights: dict[str, torch.Tensor], put_norm) -> None:
    """The HF-named weights Llama and Gemma share: embeddings, the final norm (through
    ``put_norm(module, name)``), lm_head (tied when absent or configured so), and per layer the
    fused q/k/v (with biases where the layer has them), o_proj, fused gate/up and down."""
    def take(name: str) -> torch.Tensor:
        return take_weight(weights, name)

    put(model.embed_tokens.weight, take("model.embed_tokens.weight"), "model.embed_tokens.weight")
    put_norm(model.norm, "model.norm.weight")
    if model.cfg.tie_word_embeddings or "lm_head.weight" not in weights:
        model.lm_head.weight = model.embed_tokens.weight
    else:
        put(model.lm_head.weight, weights["lm_head.weight"], "lm_head.weight")
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        a = layer.self_attn
        put(a.qkv_proj.weight, torch.cat([take(p + f"self_attn.{x}_proj.weight") for x in "qkv"]),
            p + "self_attn.qkv_proj.weight")
        if a.qkv_proj.bias is not None:
            put(a.qkv_proj.bias, torch.cat([take(p + f"self_attn.{x}_proj.bias") for x in "qkv"]),
                p + "self_attn.qkv_proj.bias")
        put(a.o_proj.weight, take(p + "self_attn.o_proj.weight"), p + "self_attn.o_proj.weight")
        gate_up = torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])
        put(layer.mlp.gate_up_proj.weight, gate_up, p + "mlp.gate_up_proj.weight")
        put(layer.mlp.down_proj.weight, take(p + "mlp.down_proj.weight"), p + "mlp.down_proj.weight")


def attach_block_weights(model: nn.Module, blocks: dict) -> int:
    """Give the Llama/Gemma linear layers the block-quantized forms of their weights
    (``BlockQuantWeight`` by HF name, from the same file as the float weights): fused q/k/v and
    gate/up where all their parts are present and of one form, o_proj, down_proj, and lm_head
    (from the embeddings when tied). Returns how many layers took them."""
    from kvos.kernels.cpu.quant_matmul import BlockQuantWeight

    def fused(layer: ops.Linear, names: list[str]) -> int:
        parts = [blocks.get(n) for n in names]
        if any(p is None for p in parts) or len({p.form for p in parts}) != 1:
            return 0
        layer.attach_blocks(parts[0] if len(parts) == 1 else BlockQuantWeight.cat(parts))
        return 1

    head = "model.embed_tokens.weight" if model.lm_head.weight is model.embed_tokens.weight else "lm_head.weight"
    n = fused(model.lm_head, [head])
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        n += fused(layer.self_attn.qkv_proj, [p + f"self_attn.{x}_proj.weight" for x in "qkv"])
        n += fused(layer.self_attn.o_proj, [p + "self_attn.o_proj.weight"])
        n += fused(layer.mlp.gate_up_proj, [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"])
        n += fused(layer.mlp.down_proj, [p + "mlp.down_proj.weight"])
    return n
