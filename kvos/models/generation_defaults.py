"""A model's recommended sampling values (vLLM's ``--generation-config auto``): what a request
that sets no temperature, top-p, top-k, min-p or repetition penalty gets."""
from __future__ import annotations

import json
from pathlib import Path

from kvos.config.generation import SAMPLING_KEYS

GGUF_DEFAULTS: dict[str, dict[str, float]] = {
    # SmolLM2's model card samples with temperature 0.2, top_p 0.9
    "SmolLM2-135M-Instruct": {"temperature": 0.2, "top_p": 0.9},
    "SmolLM2-360M-Instruct": {"temperature": 0.2, "top_p": 0.9},
    "SmolLM2-1.7B-Instruct": {"temperature": 0.2, "top_p": 0.9},
    # Gemma 3's generation_config.json: top_k 64, top_p 0.95 (temperature 1.0)
    "gemma-3-270m": {"top_k": 64, "top_p": 0.95},
}
"""GGUF files carry no generation config: the values of the model's own HF release, by file
name prefix (longest match)."""


def model_sampling_defaults(path: Path) -> dict[str, float]:
    """The sampling values ``path``'s model recommends: a folder's ``generation_config.json``
    (only ``SAMPLING_KEYS``; ``do_sample: false`` means greedy), else ``GGUF_DEFAULTS`` by the
    file's name; {} when the model says nothing."""
    if path.is_dir():
        f = path / "generation_config.json"
        if not f.exists():
            return {}
        cfg = json.loads(f.read_text())
        out = {k: cfg[k] for k in SAMPLING_KEYS if isinstance(cfg.get(k), (int, float)) and not isinstance(cfg[k], bool)}
        if cfg.get("do_sample") is False:
            out["temperature"] = 0.0
        return out
    name = path.name
    best = max((p for p in GGUF_DEFAULTS if name.lower().startswith(p.lower())), key=len, default=None)
    return dict(GGUF_DEFAULTS[best]) if best else {}
