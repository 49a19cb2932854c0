"""Idefics3 and SmolVLM: a Llama text model (``kvos.models.llama``) with a SigLIP tower whose
position embeddings are bucketed (NaViT style) and a connector that pixel-shuffles the patch grid
(``scale_factor`` per side into the channels) and projects it to the text width. An image is cut
by the processor into square tiles plus a global view; each tile is one encoder input and one run
of ``tokens_per_image`` image tokens, attended causally. Parameter names follow HF."""
from __future__ import annotations

import torch
from torch import nn

from kvos.models.config import ModelConfig, VisionShape
from kvos.models.llama import LlamaForCausalLM, put, take_weight
from kvos.models.siglip import (
    SiglipVisionTower,
    layer_norm,
    siglip_hf_name,
    split_by_prefix,
)

_TEXT_PREFIXES = ("model.text_model.", "text_model.")
_VISION_PREFIXES = ("model.vision_model.", "vision_model.")
_CONNECTOR_PREFIXES = ("model.connector.", "connector.")


def bucketed_positions(v: VisionShape) -> torch.Tensor:
    """Each patch's position-embedding row for a full ``image_size`` tile, computed with the
    float32 operations transformers' ``Idefics3VisionEmbeddings`` uses (so a rounding that maps
    two patches to one bucket maps them here too)."""
    side, cpu = v.patches_per_side, torch.device("cpu")
    boundaries = torch.arange(1 / side, 1.0, 1 / side, device=cpu)
    step = 1.0 / torch.tensor([side], device=cpu)
    coords = torch.clamp(torch.arange(side, dtype=torch.float32, device=cpu)[None, :] * step[:, None], max=1.0 - 1e-6)
    buckets = torch.bucketize(coords, boundaries, right=True)[0]
    return (buckets[:, None] * side + buckets[None, :]).reshape(-1)


class Idefics3VisionTower(SiglipVisionTower):
    """``forward(pixels [N, 3, S, S])`` -> ``[N, patches, hidden]``; SigLIP with bucketed positions."""

    def __init__(self, v: VisionShape) -> None:
        super().__init__(v)
        self.shape = v
        self._positions: torch.Tensor | None = None  # built on first use: the loader builds modules on "meta"

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        if self._positions is None or self._positions.device != x.device:
            self._positions = bucketed_positions(self.shape).to(x.device)
        x = x + self.position_embedding(self._positions)
        for layer in self.layers:
            x = layer(x)
        return layer_norm(x, self.post_layernorm)


def pixel_shuffle(x: torch.Tensor, scale: int) -> torch.Tensor:
    """``[N, side * side, h]`` -> ``[N, (side / scale)^2, h * scale^2]``: each ``scale x scale``
    block of patches becomes one token, in transformers' channel order."""
    n, seq, h = x.shape
    side = int(round(seq ** 0.5))
    x = x.view(n, side, side // scale, h * scale).permute(0, 2, 1, 3)
    x = x.reshape(n, side // scale, side // scale, h * scale * scale).permute(0, 2, 1, 3)
    return x.reshape(n, seq // (scale * scale), h * scale * scale)


class Idefics3ForConditionalGeneration(LlamaForCausalLM):
    """``encode_images(pixels [N, 3, S, S])`` (N tiles) -> ``[N, tokens_per_image, hidden]`` in
    the model's dtype; the rest is the Llama text model's interface."""

    BIDIRECTIONAL_MEDIA = False

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        v = cfg.vision
        assert v is not None and v.family == "idefics3"
        self.scale = v.scale_factor
        self.vision_model = Idefics3VisionTower(v)
        self.modality_projection = nn.Linear(v.hidden * v.scale_factor ** 2, cfg.hidden_size, bias=False)

    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        patches = self.vision_model(pixels)
        return self.modality_projection(pixel_shuffle(patches, self.scale).to(self.modality_projection.weight.dtype))

    def load_hf_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """The text weights as ``LlamaForCausalLM`` loads them (``model.text_model.*`` read as
        ``model.*``), then the tower's and the connector's. ValueError naming a missing or
        misshapen tensor."""
        text, vision, connector = split_by_prefix(weights, ((_TEXT_PREFIXES, "model."), (_VISION_PREFIXES, ""),
                                                            (_CONNECTOR_PREFIXES, "")))
        super().load_hf_weights(text)
        for name, p in self.vision_model.named_parameters():
            hf = siglip_hf_name(name)
            put(p, take_weight(vision, hf), "vision_model." + hf)
        name = "modality_projection.proj.weight"
        put(self.modality_projection.weight, take_weight(connector, name), "connector." + name)
