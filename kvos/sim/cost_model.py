"""Step time of a scheduled batch from a roofline-style cost model (pure Python)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kvos.models.config import VisionShape
from kvos.sim.hardware import GPU, WEIGHT_BYTES, kv_bytes_per_token
from kvos.sim.shapes import ModelShape


def encoder_flops(v: VisionShape, text_hidden: int) -> float:
    """One image through a SigLIP tower and the projector: patch embedding, each layer's
    projections and MLP (2 FLOPs per weight per patch) and attention (4 x patches^2 x hidden)."""
    p, h, i = v.patches_per_side ** 2, v.hidden, v.intermediate
    return (2 * p * 3 * v.patch_size ** 2 * h + v.layers * (2 * p * (4 * h * h + 2 * h * i) + 4 * p * p * h)
            + 2 * v.tokens_per_image * h * text_hidden)


@dataclass
class CostModel:
    """``time = overhead + max((weights + KV read) / bandwidth, FLOPs / peak)``, each term scaled
    by a calibration factor (1.0 = the hardware's datasheet figures).

    FLOPs: 2 × params per computed token plus attention (4 × layers × heads × head_dim per
    query-key pair). KV read: every scheduled sequence reads its whole context once per step.
    Sliding-window layers (``sliding_fraction`` of them) read and attend to at most
    ``sliding_window`` keys: the caller passes the windowed context and pairs too.
    """

    weight_bytes: float
    kv_bytes_per_token: float
    params: float
    attn_flops_per_pair: float
    bandwidth: float
    flops: float
    overhead_s: float = 0.0005
    mem_scale: float = 1.0
    compute_scale: float = 1.0
    sliding_window: int | None = None
    sliding_fraction: float = 0.0
    state_bytes_per_seq: float = 0.0
    """Mamba layers: each scheduled sequence reads and writes its whole state once per step."""
    encoder_s_per_image: float = 0.0
    """A vision model: one image through the encoder (its FLOPs at the GPU's peak, compute-scaled)."""
    encoding_bytes: float = 0.0
    """One image's encoding (tokens x hidden in 2-byte floats): what the encoder cache holds."""

    @classmethod
    def for_model(cls, shape: ModelShape, gpu: GPU, weight_dtype: str = "bf16", kv_dtype: str = "fp16",
                  tp: int = 1) -> CostModel:
        per_token = kv_bytes_per_token(shape.attention_layers, max(1, shape.num_kv_heads // tp), shape.head_dim,
                                       kv_dtype)
        return cls(weight_bytes=shape.params * WEIGHT_BYTES[weight_dtype] / tp, kv_bytes_per_token=per_token,
                   params=shape.params / tp,
                   attn_flops_per_pair=4 * shape.attention_layers * shape.num_heads * shape.head_dim / tp,
                   bandwidth=gpu.bandwidth, flops=gpu.flops,
                   sliding_window=shape.sliding_window if shape.sliding_layers else None,
                   sliding_fraction=shape.sliding_layers / shape.num_layers,
                   state_bytes_per_seq=shape.state_bytes_per_request() / tp,
                   encoder_s_per_image=(encoder_flops(shape.vision, shape.hidden_size) / gpu.flops
                                        if shape.vision is not None else 0.0),
                   encoding_bytes=(shape.vision.tokens_per_image * shape.hidden_size * 2
                                   if shape.vision is not None else 0.0))

    def step_time(self, num_tokens: int, context_tokens: int, attn_pairs: int,
                  window_context: int | None = None, window_pairs: int | None = None, num_seqs: int = 0) -> float:
        """``window_context`` / ``window_pairs``: the same counted with each query seeing at most
        ``sliding_window`` keys (default: the unwindowed figures). ``num_seqs``: sequences of the
        step (each moves its Mamba state, ``state_bytes_per_seq``, twice)."""
        if self.sliding_fraction and window_context is not None:
            f = self.sliding_fraction
            context_tokens = (1 - f) * context_tokens + f * window_context
            attn_pairs = (1 - f) * attn_pairs + f * (window_pairs if window_pairs is not None else attn_pairs)
        mem = (self.weight_bytes + context_tokens * self.kv_bytes_per_token
               + 2 * num_seqs * self.state_bytes_per_seq) / self.bandwidth
        comp = (2 * self.params * num_tokens + self.attn_flops_per_pair * attn_pairs) / self.flops
        return self.overhead_s + max(mem * self.mem_scale, comp * self.compute_scale)

    def calibrate(self, path: str | Path) -> None:
        """Fit the two scale factors to measured steps (ratio of sums per regime, so the model
        reproduces the measured total time of each regime; the per-step overhead stays fixed).

        JSON: ``{"steps": [{"num_tokens", "context_tokens", "attn_pairs", "seconds"}, ...]}``
        (``kvos bench steps`` writes one). Each step counts as memory- or compute-bound by the
        datasheet model; a regime with no steps takes the other's scale.
        """
        steps = json.loads(Path(path).read_text()).get("steps") or []
        if not steps:
            raise ValueError("calibration: no measured steps")
        sums = {"mem": [0.0, 0.0], "comp": [0.0, 0.0]}  # [measured - overhead, model]
        for st in steps:
            mem = (self.weight_bytes + st["context_tokens"] * self.kv_bytes_per_token) / self.bandwidth
            comp = (2 * self.params * st["num_tokens"] + self.attn_flops_per_pair * st.get("attn_pairs", 0)) / self.flops
            regime, model = ("mem", mem) if mem >= comp else ("comp", comp)
            sums[regime][0] += max(0.0, st["seconds"] - self.overhead_s)
            sums[regime][1] += model
        scale = {k: (m / d if d > 0 else None) for k, (m, d) in sums.items()}
        self.mem_scale = scale["mem"] or scale["comp"] or 1.0
        self.compute_scale = scale["comp"] or self.mem_scale
