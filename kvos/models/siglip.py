"""SigLIP's vision encoder (patch embedding, position embedding, pre-norm transformer layers,
final layer norm; no pooling head) and Gemma 3's projector (average pool of the patch grid to the
image's soft tokens, RMS norm, projection to the text model's width). Parameter names follow HF."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvos.models.config import VisionShape


def layer_norm(x: torch.Tensor, norm: nn.LayerNorm) -> torch.Tensor:
    """``norm(x)`` with its parameters in ``x``'s dtype (the loader may keep them in float32)."""
    return F.layer_norm(x, norm.normalized_shape, norm.weight.to(x.dtype), norm.bias.to(x.dtype), norm.eps)


def split_by_prefix(weights: dict[str, torch.Tensor], groups) -> list[dict[str, torch.Tensor]]:
    """A vision-language checkpoint's tensors split by part: ``groups`` is ``(prefixes, lead)``
    per part; a tensor goes to the first part with a prefix of its name, renamed ``lead + rest``
    (``rest`` as it is when it starts with ``lm_head``); a top-level ``lm_head.weight`` goes to
    the first part (the text model). Others are dropped."""
    out: list[dict[str, torch.Tensor]] = [{} for _ in groups]
    for name, t in weights.items():
        for (prefixes, lead), part in zip(groups, out):
            hit = next((p for p in prefixes if name.startswith(p)), None)
            if hit is not None:
                rest = name[len(hit):]
                part[rest if rest.startswith("lm_head") else lead + rest] = t
                break
        else:
            if name == "lm_head.weight":
                out[0][name] = t
    return out


def siglip_hf_name(name: str) -> str:
    """transformers' name (under ``vision_model.``) of a ``SiglipVisionTower`` parameter."""
    if name.startswith(("patch_embedding.", "position_embedding.")):
        return "embeddings." + name
    if name.startswith("layers."):
        _, i, rest = name.split(".", 2)
        return f"encoder.layers.{i}." + ("mlp." + rest if rest.startswith(("fc1.", "fc2.")) else rest)
    return name


class SiglipAttention(nn.Module):
    def __init__(self, v: VisionShape) -> None:
        super().__init__()
        self.heads, self.head_dim = v.heads, v.hidden // v.heads
        self.q_proj = nn.Linear(v.hidden, v.hidden)
        self.k_proj = nn.Linear(v.hidden, v.hidden)
        self.v_proj = nn.Linear(v.hidden, v.hidden)
        self.out_proj = nn.Linear(v.hidden, v.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = (p(x).view(b, n, self.heads, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        o = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim ** -0.5)
        return self.out_proj(o.transpose(1, 2).reshape(b, n, -1))


class SiglipEncoderLayer(nn.Module):
    def __init__(self, v: VisionShape) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(v.hidden, eps=v.layer_norm_eps)
        self.self_attn = SiglipAttention(v)
        self.layer_norm2 = nn.LayerNorm(v.hidden, eps=v.layer_norm_eps)
        self.fc1 = nn.Linear(v.hidden, v.intermediate)
        self.fc2 = nn.Linear(v.intermediate, v.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(layer_norm(x, self.layer_norm1))
        h = F.gelu(self.fc1(layer_norm(x, self.layer_norm2)), approximate="tanh")
        return x + self.fc2(h)


class SiglipVisionTower(nn.Module):
    """``forward(pixels [N, 3, S, S])`` -> ``[N, patches, hidden]`` (the last layer, normed)."""

    def __init__(self, v: VisionShape) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(3, v.hidden, kernel_size=v.patch_size, stride=v.patch_size)
        self.position_embedding = nn.Embedding(v.patches_per_side ** 2, v.hidden)
        self.layers = nn.ModuleList(SiglipEncoderLayer(v) for _ in range(v.layers))
        self.post_layernorm = nn.LayerNorm(v.hidden, eps=v.layer_norm_eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        x = x + self.position_embedding.weight
        for layer in self.layers:
            x = layer(x)
        return layer_norm(x, self.post_layernorm)


class Gemma3Projector(nn.Module):
    """Patch grid ``[N, side * side, vision hidden]`` -> ``[N, tokens_per_image, text hidden]``:
    average pooled to ``sqrt(tokens)`` per side, Gemma-RMS-normed (``1 + w``, float32 as the text
    model's norms), multiplied by ``mm_input_projection_weight`` ``[vision hidden, text hidden]``."""

    def __init__(self, v: VisionShape, text_hidden: int, norm: nn.Module) -> None:
        super().__init__()
        self.side = v.patches_per_side
        self.kernel = v.patches_per_side // int(round(v.tokens_per_image ** 0.5))
        self.mm_soft_emb_norm = norm
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(v.hidden, text_hidden))

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        n, _, h = patches.shape
        grid = patches.transpose(1, 2).reshape(n, h, self.side, self.side)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        normed = self.mm_soft_emb_norm(pooled.reshape(-1, h).contiguous()).view(n, -1, h)
        return torch.matmul(normed, self.mm_input_projection_weight).to(patches.dtype)
