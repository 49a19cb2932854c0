"""Gemma 3 as a vision-language model: the text decoder of ``kvos.models.gemma3`` with a SigLIP
tower and Gemma 3's projector. An image becomes ``tokens_per_image`` soft tokens that replace
its placeholder rows' embeddings (``forward``'s ``media_embeds``); within one image those rows
attend to each other both ways (``BIDIRECTIONAL_MEDIA``, as transformers' ``token_type_ids``
mask), so the runner never splits an image's tokens over two steps."""
from __future__ import annotations

import torch

from kvos.models.config import ModelConfig
from kvos.models.gemma3 import Gemma3ForCausalLM, GemmaRMSNorm
from kvos.models.llama import put, take_weight
from kvos.models.siglip import (
    Gemma3Projector,
    SiglipVisionTower,
    siglip_hf_name,
    split_by_prefix,
)

_TEXT_PREFIXES = ("model.language_model.model.", "model.language_model.", "language_model.model.",
                  "language_model.")
_VISION_PREFIXES = ("model.vision_tower.vision_model.", "model.vision_tower.", "vision_tower.vision_model.",
                    "vision_tower.")
_PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")


def split_vlm_weights(weights: dict[str, torch.Tensor]) -> tuple[dict, dict, dict]:
    """(text weights named as ``Gemma3ForCausalLM``'s, vision tower's, projector's) from any of
    the layouts transformers has written (``language_model.model.*``, ``model.language_model.*``;
    ``vision_tower[.vision_model].*``)."""
    text, vision, proj = split_by_prefix(weights, ((_TEXT_PREFIXES, "model."), (_VISION_PREFIXES, ""),
                                                   (_PROJECTOR_PREFIXES, "")))
    return text, vision, proj


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """``encode_images(pixels [N, 3, S, S])`` -> ``[N, tokens_per_image, hidden]`` in the model's
    dtype; the rest is the text model's interface."""

    BIDIRECTIONAL_MEDIA = True

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        assert cfg.vision is not None
        self.vision_tower = SiglipVisionTower(cfg.vision)
        self.multi_modal_projector = Gemma3Projector(
            cfg.vision, cfg.hidden_size, GemmaRMSNorm(cfg.vision.hidden, cfg.vision.layer_norm_eps))

    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.multi_modal_projector(self.vision_tower(pixels))

    def load_hf_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """The text weights as ``Gemma3ForCausalLM`` loads them, then the tower's and the
        projector's (its norm as ``1 + w``). ValueError naming a missing or misshapen tensor."""
        text, vision, proj = split_vlm_weights(weights)
        super().load_hf_weights(text)
        for name, p in self.vision_tower.named_parameters():
            hf = siglip_hf_name(name)
            put(p, take_weight(vision, hf), "vision_tower." + hf)
        put(self.multi_modal_projector.mm_input_projection_weight,
            take_weight(proj, "mm_input_projection_weight"), "multi_modal_projector.mm_input_projection_weight")
        put(self.multi_modal_projector.mm_soft_emb_norm.weight,
            1.0 + take_weight(proj, "mm_soft_emb_norm.weight").float(), "multi_modal_projector.mm_soft_emb_norm.weight")
