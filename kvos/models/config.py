"""Architecture hyper-parameters of a decoder-only model, read from GGUF metadata or config.json."""
from __future__ import annotations

from dataclasses import dataclass, field

SUPPORTED_ARCHS = {
    "llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
    "gemma3": "gemma3", "gemma3_text": "gemma3",
    "LlamaForCausalLM": "llama", "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3", "Gemma3ForConditionalGeneration": "gemma3",
    "bamba": "bamba", "BambaForCausalLM": "bamba",
    "granitemoehybrid": "granitemoehybrid", "GraniteMoeHybridForCausalLM": "granitemoehybrid",
    "mamba2": "mamba2", "Mamba2ForCausalLM": "mamba2",
    "idefics3": "idefics3", "Idefics3ForConditionalGeneration": "idefics3",
    "smolvlm": "idefics3", "SmolVLMForConditionalGeneration": "idefics3",
}
SUPPORTED_NAMES = ("Llama, Mistral, Qwen2, Qwen3, Gemma 3 (text and vision), Bamba, Granite 4.0-H (GraniteMoeHybrid), "
                   "Mamba2, Idefics3 / SmolVLM")
HYBRID_ARCHS = ("bamba", "granitemoehybrid", "mamba2")
"""Architectures with Mamba2 layers (``kvos.models.hybrid``)."""
MAMBA_LAYER_TYPES = ("mamba", "linear_attention")
ATTENTION_LAYER_TYPES = ("attention", "full_attention")


@dataclass(frozen=True)
class MambaShape:
    """A Mamba2 layer's sizes (``intermediate = num_heads * head_dim``) and constants."""

    num_heads: int
    head_dim: int
    state_size: int
    groups: int
    conv_kernel: int
    conv_bias: bool = True
    proj_bias: bool = False
    norm_eps: float = 1e-5
    dt_min: float = 0.0
    dt_max: float = float("inf")

    @property
    def intermediate(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.intermediate + 2 * self.groups * self.state_size

    @property
    def conv_width(self) -> int:
        """Inputs the causal convolution keeps between steps."""
        return self.conv_kernel - 1

@dataclass(frozen=True)
class VisionShape:
    """A vision-language model's image side: a SigLIP encoder (``hidden``, ``layers``, ``heads``,
    square ``image_size`` images cut into ``patch_size`` patches) and a projector to
    ``tokens_per_image`` soft tokens of the text model's width. ``family``:

    - ``"gemma3"``: one ``image_size`` square per image, its patches average-pooled; the prompt
      holds the image tokens between ``boi_token_id`` and ``eoi_token_id``; the text layers'
      attention among one image's tokens is not causal (``bidirectional``).
    - ``"idefics3"`` (Idefics3, SmolVLM): an image is cut into up to ``max_tiles_per_side`` squared
      tiles of ``image_size`` plus a global view, each a run of ``tokens_per_image`` image tokens
      (patches pixel-shuffled by ``scale_factor``), the runs framed by the processor's
      ``<fake_token_around_image>`` and row/column tags (``boi_token_id`` and ``eoi_token_id``
      are -1: config.json does not name them); causal attention.

    ``tokens_per_image`` is per tile: one ``MediaItem`` (one encoder input) each."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    image_size: int
    patch_size: int
    tokens_per_image: int
    image_token_id: int
    boi_token_id: int
    eoi_token_id: int
    layer_norm_eps: float = 1e-6
    bidirectional: bool = True
    family: str = "gemma3"
    scale_factor: int = 1
    """Idefics3: patches merged per side by the pixel shuffle."""
    max_tiles_per_side: int = 1
    """Idefics3: tiles per side of the largest image (the processor's ``size`` over ``image_size``)."""

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def max_tiles_per_image(self) -> int:
        """Encoder inputs of the largest image: its tiles and, when cut, the global view."""
        n = self.max_tiles_per_side
        return n * n + 1 if n > 1 else 1

    @property
    def prompt_tokens_per_image(self) -> int:
        """What the largest image adds to a prompt as the model's processor writes it. Gemma 3:
        a blank line, the start token, the image tokens, the end token, a blank line. Idefics3:
        per tile a frame token, a row/column tag and the image tokens, a newline per row, then a
        newline, the global view's frame, tag and image tokens, and a closing frame."""
        if self.family == "idefics3":
            n = self.max_tiles_per_side
            tiles = n * n * (self.tokens_per_image + 2) + n + 1 if n > 1 else 0
            return tiles + self.tokens_per_image + 3
        return self.tokens_per_image + 4

    def num_params(self, text_hidden: int) -> int:
        """The encoder's and the projector's weights (the planner counts them with the text model's)."""
        h, i, n = self.hidden, self.intermediate, self.patches_per_side ** 2
        layer = 4 * (h * h + h) + 2 * h * i + i + h + 4 * h
        tower = 3 * self.patch_size ** 2 * h + h + n * h + self.layers * layer + 2 * h
        if self.family == "idefics3":
            return tower + h * self.scale_factor ** 2 * text_hidden
        return tower + h + h * text_hidden


GEMMA3_VISION_DEFAULTS = {
    "hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27, "num_attention_heads": 16,
    "image_size": 896, "patch_size": 14, "layer_norm_eps": 1e-6,
}
"""transformers' SigLIP defaults as Gemma 3 uses them (so400m, 896 px, 14 px patches)."""


IDEFICS3_VISION_DEFAULTS = {
    "hidden_size": 1152, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 16,
    "image_size": 224, "patch_size": 32, "layer_norm_eps": 1e-6,
}
"""transformers' ``Idefics3VisionConfig`` defaults (SmolVLM's are the same)."""


GEMMA3_DEFAULTS = {
    "vocab_size": 262208, "head_dim": 256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, "query_pre_attn_scalar": 256,
    "sliding_window": 4096, "tie_word_embeddings": True,
    "bos_token_id": 2, "eos_token_id": 1,
}
"""transformers' ``Gemma3TextConfig`` defaults: Google's config.json files rely on them (the 12B and
27B ``text_config`` list only what differs)."""


@dataclass
class ModelConfig:
    arch: str  # "llama" | "qwen2" | "qwen3" | "gemma3"
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    name: str = ""
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    """Per layer ``"full_attention"`` or ``"sliding_attention"`` (the latter attends to the last
    ``sliding_window`` positions, itself included); None: every layer slides when
    ``sliding_window`` is set (Mistral), else every layer is full."""

    rope_local_theta: float | None = None
    """Rotary base of the ``"sliding_attention"`` layers, which then use no ``rope_scaling``
    (Gemma 3: 10,000, while full layers use ``rope_theta`` and ``rope_scaling``); None: every
    layer uses ``rope_theta`` and ``rope_scaling``."""
    query_pre_attn_scalar: float | None = None
    """Attention scale ``query_pre_attn_scalar ** -0.5`` (Gemma); None: ``head_dim ** -0.5``."""

    mamba: MambaShape | None = None
    """The Mamba2 layers' shape (hybrid and pure Mamba2 models), else None."""
    mamba_layers: list[int] = field(default_factory=list)
    """The layers that are Mamba2 mixers (their state is a cache group of its own)."""
    rotary_fraction: float = 1.0
    """Share of each head's dimensions that RoPE rotates (the first ones; Bamba: 0.5); 0: no RoPE."""
    attention_multiplier: float | None = None
    """Attention scale (Granite); None: ``attn_scale``'s rule."""
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    """Logits are divided by it (Granite)."""
    num_experts: int = 0
    num_experts_per_tok: int = 0
    shared_intermediate_size: int = 0
    """Granite 4.0-H: the shared MLP's width; the experts' is ``intermediate_size``."""
    vision: VisionShape | None = None
    """A vision-language model's encoder and image tokens (``kvos.models.siglip``), else None."""

    @property
    def attn_scale(self) -> float:
        if self.attention_multiplier is not None:
            return self.attention_multiplier
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def layer_window(self, layer: int) -> int | None:
        """The number of most recent positions layer ``layer`` attends to (None: all)."""
        if not self.sliding_window:
            return None
        if self.layer_types is None or self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    def layer_windows(self) -> list[int | None]:
        return [self.layer_window(i) for i in range(self.num_layers)]

    @classmethod
    def from_hf(cls, cfg: dict, name: str = "") -> ModelConfig:
        archs = cfg.get("architectures") or [cfg.get("model_type", "")]
        arch = SUPPORTED_ARCHS.get(archs[0]) or SUPPORTED_ARCHS.get(cfg.get("model_type", ""))
        if arch is None:
            raise ValueError(f"model: architecture {archs[0]!r} is not supported "
                             f"(supported: {SUPPORTED_NAMES})")
        if arch == "gemma3":
            return cls._gemma3_from_hf(cfg, name)
        if arch == "idefics3":
            return cls._idefics3_from_hf(cfg, name)
        if arch in HYBRID_ARCHS:
            return cls._hybrid_from_hf(arch, cfg, name)
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", arch == "llama") else None
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or None
        theta = cfg.get("rope_theta") or (rope or {}).get("rope_theta") or 10000.0
        if rope and rope.get("rope_type", rope.get("type")) in (None, "default"):
            rope = None
        return cls(
            arch=arch, hidden_size=cfg["hidden_size"], num_layers=cfg["num_hidden_layers"],
            num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            intermediate_size=cfg["intermediate_size"], vocab_size=cfg["vocab_size"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=float(theta), rope_scaling=rope,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            qkv_bias=cfg.get("attention_bias", arch == "qwen2"), qk_norm=arch == "qwen3",
            eos_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
            bos_token_id=cfg.get("bos_token_id"), name=name, sliding_window=window or None,
            layer_types=cfg.get("layer_types") if window else None)

    @classmethod
    def _gemma3_from_hf(cls, cfg: dict, name: str) -> ModelConfig:
        """Gemma 3's text model: ``Gemma3ForCausalLM`` / ``gemma3_text`` fields at the top level, or
        ``Gemma3ForConditionalGeneration``'s ``text_config`` with its ``vision_config`` (``vision``).
        Missing fields take transformers' defaults; both the legacy rope fields (``rope_theta``,
        ``rope_local_base_freq``, ``rope_scaling`` for the full layers) and transformers 5's
        per-layer-type ``rope_parameters`` are read."""
        text = dict(cfg.get("text_config") or cfg)
        for key in ("eos_token_id", "bos_token_id", "tie_word_embeddings"):
            if key not in text and key in cfg:
                text[key] = cfg[key]
        t = {**GEMMA3_DEFAULTS, **{k: v for k, v in text.items() if v is not None or k == "sliding_window"}}
        for key in ("final_logit_softcapping", "attn_logit_softcapping"):
            if text.get(key) is not None:
                raise ValueError(f"model: Gemma 3 with {key}={text[key]} is not supported "
                                 f"(Gemma 3 has no soft-capping; this looks like a Gemma 2 config)")
        if text.get("use_bidirectional_attention"):
            raise ValueError("model: Gemma 3 with use_bidirectional_attention is not supported")
        act = text.get("hidden_activation") or text.get("hidden_act") or "gelu_pytorch_tanh"
        if act != "gelu_pytorch_tanh":
            raise ValueError(f"model: Gemma 3 activation {act!r} is not supported (gelu_pytorch_tanh)")
        layers = t["num_hidden_layers"]
        layer_types = text.get("layer_types")
        if layer_types is None:
            pattern = text.get("sliding_window_pattern") or text.get("_sliding_window_pattern") or 6
            layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
        if len(layer_types) != layers:
            raise ValueError(f"model: layer_types has {len(layer_types)} entries for {layers} layers")
        theta, local_theta, scaling = t["rope_theta"], t["rope_local_base_freq"], t.get("rope_scaling")
        params = text.get("rope_parameters")
        if isinstance(params, dict) and "full_attention" in params:  # transformers 5 format
            full, local = dict(params["full_attention"] or {}), dict(params.get("sliding_attention") or {})
            theta = full.pop("rope_theta", theta)
            local_theta = local.pop("rope_theta", local_theta)
            if local.get("rope_type", "default") != "default":
                raise ValueError(f"model: rope scaling {local} on sliding layers is not supported")
            scaling = full
        if scaling and scaling.get("rope_type", scaling.get("type")) in (None, "default"):
            scaling = None
        if text.get("attention_bias"):
            raise ValueError("model: Gemma 3 with attention_bias is not supported")
        heads = t["num_attention_heads"]
        eos = t.get("eos_token_id")
        return cls(
            arch="gemma3", hidden_size=t["hidden_size"], num_layers=layers, num_heads=heads,
            num_kv_heads=t.get("num_key_value_heads") or heads, head_dim=t["head_dim"],
            intermediate_size=t["intermediate_size"], vocab_size=t["vocab_size"],
            rms_norm_eps=t["rms_norm_eps"], rope_theta=float(theta), rope_scaling=scaling or None,
            max_position_embeddings=t["max_position_embeddings"],
            tie_word_embeddings=t["tie_word_embeddings"], qk_norm=True,
            eos_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
            bos_token_id=t.get("bos_token_id"), name=name, sliding_window=t["sliding_window"] or None,
            layer_types=list(layer_types), rope_local_theta=float(local_theta),
            query_pre_attn_scalar=t["query_pre_attn_scalar"], vision=cls._gemma3_vision(cfg))

    @staticmethod
    def _gemma3_vision(cfg: dict) -> VisionShape | None:
        """``Gemma3ForConditionalGeneration``'s SigLIP tower and image tokens (transformers'
        defaults where config.json leaves them out), or None for a text-only config."""
        if "vision_config" not in cfg:
            return None
        v = {**GEMMA3_VISION_DEFAULTS, **{k: x for k, x in (cfg["vision_config"] or {}).items() if x is not None}}
        if v.get("vision_use_head"):
            raise ValueError("model: a SigLIP tower with vision_use_head is not supported")
        act = v.get("hidden_act", "gelu_pytorch_tanh")
        if act != "gelu_pytorch_tanh":
            raise ValueError(f"model: vision activation {act!r} is not supported (gelu_pytorch_tanh)")
        tokens = int(cfg.get("mm_tokens_per_image", 256))
        side, per_side = int(round(tokens ** 0.5)), v["image_size"] // v["patch_size"]
        if side * side != tokens or per_side % side:
            raise ValueError(f"model: mm_tokens_per_image={tokens} must be a square whose side divides the "
                             f"{per_side} patches per side")
        return VisionShape(
            hidden=v["hidden_size"], intermediate=v["intermediate_size"], layers=v["num_hidden_layers"],
            heads=v["num_attention_heads"], image_size=v["image_size"], patch_size=v["patch_size"],
            tokens_per_image=tokens, image_token_id=int(cfg.get("image_token_index", cfg.get("image_token_id", 262144))),
            boi_token_id=int(cfg.get("boi_token_index", 255999)), eoi_token_id=int(cfg.get("eoi_token_index", 256000)),
            layer_norm_eps=float(v["layer_norm_eps"]))

    @classmethod
    def _idefics3_from_hf(cls, cfg: dict, name: str) -> ModelConfig:
        """Idefics3 / SmolVLM: the Llama ``text_config`` read as a Llama config, with the SigLIP
        tower of ``vision_config`` and the pixel-shuffle connector (transformers' defaults where
        config.json leaves fields out). ``max_tiles_per_side`` is the processor's (default 4,
        SmolVLM's); the engine reads the checkpoint's own when it prepares images."""
        text = dict(cfg.get("text_config") or {})
        if text.get("model_type", "llama") not in ("llama", "mistral"):
            raise ValueError(f"model: an Idefics3 text model of type {text['model_type']!r} is not supported (llama)")
        for key in ("eos_token_id", "bos_token_id", "tie_word_embeddings"):
            if key not in text and key in cfg:
                text[key] = cfg[key]
        base = cls.from_hf({**text, "architectures": ["LlamaForCausalLM"]}, name)
        v = {**IDEFICS3_VISION_DEFAULTS, **{k: x for k, x in (cfg.get("vision_config") or {}).items() if x is not None}}
        act = v.get("hidden_act", "gelu_pytorch_tanh")
        if act != "gelu_pytorch_tanh":
            raise ValueError(f"model: vision activation {act!r} is not supported (gelu_pytorch_tanh)")
        if not isinstance(v["image_size"], int) or not isinstance(v["patch_size"], int):
            raise ValueError("model: vision_config.image_size and patch_size must be integers (square images)")
        scale = int(cfg.get("scale_factor", 2))
        side = v["image_size"] // v["patch_size"]
        if side % scale:
            raise ValueError(f"model: scale_factor={scale} must divide the {side} patches per side")
        image_token = int(cfg.get("image_token_id", cfg.get("image_token_index", 128257)))
        base.vision = VisionShape(
            hidden=v["hidden_size"], intermediate=v["intermediate_size"], layers=v["num_hidden_layers"],
            heads=v["num_attention_heads"], image_size=v["image_size"], patch_size=v["patch_size"],
            tokens_per_image=(side // scale) ** 2, image_token_id=image_token,
            boi_token_id=-1, eoi_token_id=-1,
            layer_norm_eps=float(v["layer_norm_eps"]), bidirectional=False, family="idefics3",
            scale_factor=scale, max_tiles_per_side=int(cfg.get("max_tiles_per_side", 4)))
        return base

    @classmethod
    def _hybrid_from_hf(cls, arch: str, cfg: dict, name: str) -> ModelConfig:
        """Bamba, Granite 4.0-H and Mamba2 config.json files (their own field names and
        transformers' defaults). Layer kinds: Bamba's ``attn_layer_indices``, Granite's
        ``layer_types`` (``mamba``/``attention``, or transformers 5's
        ``linear_attention``/``full_attention``); any other kind is refused, naming the layer."""
        layers = cfg["num_hidden_layers"]
        hidden = cfg["hidden_size"]
        if arch == "mamba2":
            kinds = ["mamba"] * layers
            p = {"heads": cfg.get("num_heads", 128), "head_dim": cfg.get("head_dim", 64),
                 "state": cfg.get("state_size", 128), "groups": cfg.get("n_groups", 8),
                 "kernel": cfg.get("conv_kernel", 4), "expand": cfg.get("expand", 2),
                 "conv_bias": cfg.get("use_conv_bias", True), "bias": cfg.get("use_bias", False),
                 "eps": cfg.get("layer_norm_epsilon", 1e-5)}
        else:
            if arch == "bamba" and cfg.get("layer_types") is None:
                attn = set(cfg.get("attn_layer_indices") or [])
                kinds = ["attention" if i in attn else "mamba" for i in range(layers)]
            else:
                kinds = list(cfg.get("layer_types") or cfg.get("layers_block_type") or ["mamba"] * layers)
            heads = cfg.get("mamba_n_heads", 128)
            d_head = cfg.get("mamba_d_head", "auto")
            expand = cfg.get("mamba_expand", 2)
            p = {"heads": heads, "head_dim": expand * hidden // heads if d_head == "auto" else d_head,
                 "state": cfg.get("mamba_d_state", 256),
                 "groups": cfg.get("mamba_n_groups", 1), "kernel": cfg.get("mamba_d_conv", 4), "expand": expand,
                 "conv_bias": cfg.get("mamba_conv_bias", True), "bias": cfg.get("mamba_proj_bias", False),
                 "eps": cfg.get("rms_norm_eps", 1e-5)}
        if len(kinds) != layers:
            raise ValueError(f"model: layer_types has {len(kinds)} entries for {layers} layers")
        for i, kind in enumerate(kinds):
            if kind not in MAMBA_LAYER_TYPES + ATTENTION_LAYER_TYPES:
                raise ValueError(f"model: layer {i} has type {kind!r}, which kvos does not know "
                                 f"(known: {', '.join(MAMBA_LAYER_TYPES + ATTENTION_LAYER_TYPES)})")
        if p["heads"] * p["head_dim"] != p["expand"] * hidden:
            raise ValueError(f"model: mamba heads x head_dim ({p['heads']} x {p['head_dim']}) must equal "
                             f"expand x hidden_size ({p['expand']} x {hidden})")
        limit = cfg.get("time_step_limit") or (0.0, float("inf"))
        dt_max = limit[1]
        if isinstance(dt_max, dict) or dt_max is None:  # transformers writes inf as {"__float__": "Infinity"}
            dt_max = float("inf")
        shape = MambaShape(p["heads"], p["head_dim"], p["state"], p["groups"], p["kernel"], bool(p["conv_bias"]),
                           bool(p["bias"]), float(p["eps"]), float(limit[0]), float(dt_max))
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        theta = float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0)
        fraction = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
        if arch == "bamba":
            fraction = 0.5  # transformers' Bamba rotates half of each head whatever config.json says
        if arch == "granitemoehybrid" and cfg.get("position_embedding_type", "nope") != "rope":
            fraction = 0.0
        if rope.get("rope_type", "default") not in ("default", None):
            raise ValueError(f"model: rope scaling {rope.get('rope_type')!r} is not supported for {arch}")
        heads = cfg.get("num_attention_heads", 1)
        eos = cfg.get("eos_token_id")
        granite = arch == "granitemoehybrid"
        return cls(
            arch=arch, hidden_size=hidden, num_layers=layers, num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            intermediate_size=cfg.get("intermediate_size", 0), vocab_size=cfg["vocab_size"],
            rms_norm_eps=cfg.get("rms_norm_eps", cfg.get("layer_norm_epsilon", 1e-5)), rope_theta=theta,
            max_position_embeddings=cfg.get("max_position_embeddings", 1 << 20),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            qkv_bias=cfg.get("attention_bias", False),
            eos_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
            bos_token_id=cfg.get("bos_token_id"), name=name,
            mamba=shape, mamba_layers=[i for i, k in enumerate(kinds) if k in MAMBA_LAYER_TYPES],
            rotary_fraction=fraction,
            attention_multiplier=cfg.get("attention_multiplier") if granite else None,
            embedding_multiplier=float(cfg.get("embedding_multiplier", 1.0)) if granite else 1.0,
            residual_multiplier=float(cfg.get("residual_multiplier", 1.0)) if granite else 1.0,
            logits_scaling=float(cfg.get("logits_scaling", 1.0)) if granite else 1.0,
            num_experts=cfg.get("num_local_experts", 0) if granite else 0,
            num_experts_per_tok=cfg.get("num_experts_per_tok", 0) if granite else 0,
            shared_intermediate_size=cfg.get("shared_intermediate_size", 0) if granite else 0)

    @property
    def attention_layers(self) -> list[int]:
        """Layers that attend (every layer but the Mamba ones)."""
        mamba = set(self.mamba_layers)
        return [i for i in range(self.num_layers) if i not in mamba]

    @property
    def kv_bytes_per_token_fp32(self) -> int:
        return 2 * len(self.attention_layers) * self.num_kv_heads * self.head_dim * 4
