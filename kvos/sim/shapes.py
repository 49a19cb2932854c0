"""Model shapes for planning: presets, HF config.json and GGUF metadata (no weights loaded)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kvos.models.config import (
    HYBRID_ARCHS,
    SUPPORTED_ARCHS,
    MambaShape,
    ModelConfig,
    VisionShape,
)


@dataclass(frozen=True)
class ModelShape:
    """What memory math needs of a decoder. ``sliding_layers`` of the ``num_layers`` attend to at
    most ``sliding_window`` tokens; the rest attend to everything. ``layer_types`` (per layer
    ``"sliding_attention"`` or ``"full_attention"``) places them when known; else the full layers
    are spread evenly, the last of each period (Gemma 3: layers 5, 11, 17, ...)."""

    name: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    tie_embeddings: bool = False
    sliding_window: int | None = None
    sliding_layers: int = 0
    num_params: int | None = None
    layer_types: tuple[str, ...] | None = None
    mamba: MambaShape | None = None
    """The Mamba2 layers' shape (hybrid models): their state is a page per request, whatever its length."""
    mamba_layers: tuple[int, ...] = ()
    num_experts: int = 0
    """A mixture of experts per layer (Granite 4.0-H) of ``expert_intermediate`` each, beside the MLP."""
    expert_intermediate: int = 0
    vision: VisionShape | None = None
    """A vision-language model's encoder (its weights count) and image tokens."""

    def __post_init__(self) -> None:
        if not 0 <= self.sliding_layers <= self.num_layers:
            raise ValueError(f"model: sliding_layers must be in [0, {self.num_layers}], got {self.sliding_layers}")
        if self.sliding_layers and not self.sliding_window:
            raise ValueError("model: sliding layers need a sliding_window")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                raise ValueError(f"model: layer_types has {len(self.layer_types)} entries for "
                                 f"{self.num_layers} layers")
            if sum(t == "sliding_attention" for t in self.layer_types) != self.sliding_layers:
                raise ValueError("model: layer_types disagrees with sliding_layers")

    @property
    def full_layers(self) -> int:
        return self.num_layers - self.sliding_layers

    @property
    def attention_layers(self) -> int:
        return self.num_layers - len(self.mamba_layers)

    @property
    def is_hybrid(self) -> bool:
        """Some layers slide or keep Mamba state: the cache has several groups."""
        return self.sliding_layers > 0 or bool(self.mamba_layers)

    def state_bytes_per_request(self) -> int:
        """Every Mamba layer's conv and SSM state (float32): what one request holds in the state group."""
        m = self.mamba
        if m is None:
            return 0
        return len(self.mamba_layers) * (m.conv_dim * m.conv_width + m.num_heads * m.head_dim * m.state_size) * 4

    def layer_windows(self) -> list[int | None]:
        """Each layer's attention window (None: full attention), as ``build_layout`` takes it."""
        n, w = self.num_layers, self.sliding_window
        if self.layer_types is not None:
            return [w if t == "sliding_attention" else None for t in self.layer_types]
        if not self.sliding_layers:
            return [None] * n
        if not self.full_layers:
            return [w] * n
        period = n // self.full_layers
        return [None if (i + 1) % period == 0 and i < period * self.full_layers else w for i in range(n)]

    @property
    def params(self) -> int:
        """Parameter count (given, or from the dense llama-style layout)."""
        if self.num_params is not None:
            return self.num_params
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h
        mlp = 3 * h * self.intermediate_size + 2 * h
        embed = self.vocab_size * h * (1 if self.tie_embeddings else 2)
        mixer = 0
        if self.mamba is not None:
            m = self.mamba
            mixer = h * (m.intermediate + m.conv_dim + m.num_heads) + m.conv_dim * (m.conv_kernel + 1) \
                + 3 * m.num_heads + m.intermediate * (h + 1)
        experts = self.num_experts * (3 * h * self.expert_intermediate + h)
        vision = self.vision.num_params(h) if self.vision is not None else 0
        return embed + self.attention_layers * (attn + mlp) + len(self.mamba_layers) * (mixer + mlp) \
            + self.num_layers * experts + h + vision


GEMMA3_SIGLIP = VisionShape(hidden=1152, intermediate=4304, layers=27, heads=16, image_size=896, patch_size=14,
                            tokens_per_image=256, image_token_id=262144, boi_token_id=255999, eoi_token_id=256000)
"""Gemma 3's vision tower (4B and larger): SigLIP so400m at 896 px, 256 tokens per image."""

SMOLVLM_SIGLIP = VisionShape(hidden=768, intermediate=3072, layers=12, heads=12, image_size=512, patch_size=16,
                             tokens_per_image=64, image_token_id=49190, boi_token_id=-1, eoi_token_id=-1,
                             bidirectional=False, family="idefics3", scale_factor=4, max_tiles_per_side=4)
"""SmolVLM-256M/500M's vision side as their model card gives it: SigLIP base-patch16 at 512 px,
pixel shuffle 4 (64 tokens per tile), tiles of 512 up to a 2048 px longest edge."""

PRESETS: dict[str, ModelShape] = {s.name: s for s in [
    ModelShape("llama-3-70b", 80, 64, 8, 128, 8192, 28672, 128256),
    ModelShape("llama-3.1-8b", 32, 32, 8, 128, 4096, 14336, 128256),
    ModelShape("llama-3.2-1b", 16, 32, 8, 64, 2048, 8192, 128256, tie_embeddings=True),
    ModelShape("mistral-7b", 32, 32, 8, 128, 4096, 14336, 32768),
    ModelShape("qwen2.5-7b", 28, 28, 4, 128, 3584, 18944, 152064),
    ModelShape("qwen3-8b", 36, 32, 8, 128, 4096, 12288, 151936),
    ModelShape("smollm2-135m", 30, 9, 3, 64, 576, 1536, 49152, tie_embeddings=True),
    ModelShape("smolvlm-256m", 30, 9, 3, 64, 576, 1536, 49280, tie_embeddings=True, vision=SMOLVLM_SIGLIP),
    ModelShape("gemma-3-270m", 18, 4, 1, 256, 640, 2048, 262144, tie_embeddings=True,
               sliding_window=512, sliding_layers=15),
    ModelShape("gemma-3-12b", 48, 16, 8, 256, 3840, 15360, 262208, tie_embeddings=True,
               sliding_window=1024, sliding_layers=40, vision=GEMMA3_SIGLIP),
    ModelShape("gemma-3-27b", 62, 32, 16, 128, 5376, 21504, 262208, tie_embeddings=True,
               sliding_window=1024, sliding_layers=52, vision=GEMMA3_SIGLIP),
    # transformers' BambaConfig defaults (its reference checkpoint: Bamba-9.8B), attention at 9, 18, 27
    ModelShape("bamba-9b", 32, 32, 8, 128, 4096, 14336, 128000, mamba=MambaShape(128, 64, 256, 1, 4),
               mamba_layers=tuple(i for i in range(32) if i not in (9, 18, 27))),
]}


def _hybrid_shape(cfg: dict, name: str) -> ModelShape:
    """Bamba, Granite 4.0-H and Mamba2 configs, read as the engine does (``ModelConfig``)."""
    mc = ModelConfig.from_hf(cfg, name)
    return ModelShape(name=name or mc.arch, num_layers=mc.num_layers, num_heads=mc.num_heads,
                      num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim, hidden_size=mc.hidden_size,
                      intermediate_size=mc.shared_intermediate_size or mc.intermediate_size,
                      vocab_size=mc.vocab_size, tie_embeddings=mc.tie_word_embeddings, mamba=mc.mamba,
                      mamba_layers=tuple(mc.mamba_layers), num_experts=mc.num_experts,
                      expert_intermediate=mc.intermediate_size if mc.num_experts else 0)


def shape_from_hf_config(cfg: dict, name: str = "") -> ModelShape:
    archs = cfg.get("architectures") or [cfg.get("model_type", "")]
    if SUPPORTED_ARCHS.get(archs[0], SUPPORTED_ARCHS.get(cfg.get("model_type", ""))) in HYBRID_ARCHS:
        return _hybrid_shape(cfg, name)
    text = cfg.get("text_config", cfg)
    if str(text.get("model_type") or cfg.get("model_type") or "").startswith("gemma3"):
        return _gemma3_shape(cfg, name)
    heads = text["num_attention_heads"]
    layers = text["num_hidden_layers"]
    window = text.get("sliding_window") if text.get("use_sliding_window", True) else None
    sliding = 0
    types = text.get("layer_types") if window else None
    if window:
        if types:
            sliding = sum(1 for t in types if t == "sliding_attention")
        elif text.get("sliding_window_pattern"):
            p = text["sliding_window_pattern"]
            sliding = layers - layers // p
        else:
            sliding = layers  # Mistral-style: every layer slides
    return ModelShape(
        name=name or text.get("model_type", "model"), num_layers=layers, num_heads=heads,
        num_kv_heads=text.get("num_key_value_heads") or heads,
        head_dim=text.get("head_dim") or text["hidden_size"] // heads, hidden_size=text["hidden_size"],
        intermediate_size=text["intermediate_size"], vocab_size=text["vocab_size"],
        tie_embeddings=cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False)),
        sliding_window=window if sliding else None, sliding_layers=sliding,
        layer_types=tuple(types) if types and sliding else None,
        vision=ModelConfig.from_hf(cfg).vision if SUPPORTED_ARCHS.get(archs[0]) == "idefics3" else None)


def _gemma3_shape(cfg: dict, name: str) -> ModelShape:
    """Gemma 3 configs leave fields to transformers' defaults (the 27B's ``text_config`` has no
    ``vocab_size`` nor layer pattern): read them as the engine does."""
    from kvos.models.config import ModelConfig

    try:
        mc = ModelConfig.from_hf(cfg, name)
    except KeyError as e:
        raise ValueError(f"model: config.json lacks {e}") from None
    types = tuple(mc.layer_types or ())
    sliding = sum(1 for t in types if t == "sliding_attention") if mc.sliding_window else 0
    return ModelShape(name=name or "gemma3", num_layers=mc.num_layers, num_heads=mc.num_heads,
                      num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim, hidden_size=mc.hidden_size,
                      intermediate_size=mc.intermediate_size, vocab_size=mc.vocab_size,
                      tie_embeddings=mc.tie_word_embeddings, sliding_window=mc.sliding_window if sliding else None,
                      sliding_layers=sliding, layer_types=types if sliding else None, vision=mc.vision)


def shape_from_gguf(path: Path) -> ModelShape:
    from gguf import GGUFReader

    try:
        r = GGUFReader(str(path))
    except Exception as e:
        raise ValueError(f"model: {path} is not a valid GGUF file ({e})") from e

    def f(key, default=None):
        field = r.fields.get(key)
        return default if field is None else field.contents()

    a = f("general.architecture")
    heads = int(f(f"{a}.attention.head_count"))
    hidden = int(f(f"{a}.embedding_length"))
    layers = int(f(f"{a}.block_count"))
    window = f(f"{a}.attention.sliding_window")
    sliding = 0
    if window and a.startswith("gemma"):
        sliding = layers - layers // 6  # Gemma 2/3: five sliding layers to one global
    names = {t.name for t in r.tensors}
    return ModelShape(
        name=path.name, num_layers=layers, num_heads=heads,
        num_kv_heads=int(f(f"{a}.attention.head_count_kv", heads)),
        head_dim=int(f(f"{a}.attention.key_length", hidden // heads)), hidden_size=hidden,
        intermediate_size=int(f(f"{a}.feed_forward_length")),
        vocab_size=int(f(f"{a}.vocab_size", 0)) or int(next(t.shape[-1] for t in r.tensors
                                                            if t.name == "token_embd.weight")),
        tie_embeddings="output.weight" not in names, sliding_window=int(window) if sliding else None,
        sliding_layers=sliding, num_params=int(sum(int(t.n_elements) for t in r.tensors)))


def _processor_tiles(folder: Path) -> int | None:
    """An Idefics3-style processor's tiles per side (its ``size`` over its ``max_image_size``
    longest edges), read from the folder's processor config; None without one."""
    for name in ("preprocessor_config.json", "processor_config.json"):
        if (folder / name).exists():
            cfg = json.loads((folder / name).read_text())
            cfg = cfg.get("image_processor", cfg)
            size, tile = (cfg.get("size") or {}).get("longest_edge"), (cfg.get("max_image_size") or {}).get("longest_edge")
            return max(1, -(-size // tile)) if size and tile else None
    return None


def resolve_shape(model: str) -> ModelShape:
    """A preset name, a config.json (or a folder holding one), or a .gguf file."""
    if model.lower() in PRESETS:
        return PRESETS[model.lower()]
    path = Path(model).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".gguf" and path.exists():
        return shape_from_gguf(path)
    if path.exists():
        cfg = json.loads(path.read_text())
        tiles = _processor_tiles(path.parent)
        if tiles is not None:
            cfg["max_tiles_per_side"] = tiles
        return shape_from_hf_config(cfg, name=path.parent.name or path.stem)
    raise ValueError(f"model: {model!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor a "
                     f"config.json / .gguf path")
