"""Architecture hyper-parameters of a decoder-only model, read from GGUF metadata or config.json."""
from __future__ import annotations

from dataclasses import dataclass, field

SUPPORTED_ARCHS = {
    "llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
    "LlamaForCausalLM": "llama", "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
}


@dataclass
class ModelConfig:
    arch: str  # "llama" | "qwen2" | "qwen3"
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

    @classmethod
    def from_hf(cls, cfg: dict, name: str = "") -> ModelConfig:
        archs = cfg.get("architectures") or [cfg.get("model_type", "")]
        arch = SUPPORTED_ARCHS.get(archs[0]) or SUPPORTED_ARCHS.get(cfg.get("model_type", ""))
        if arch is None:
            raise ValueError(f"model: architecture {archs[0]!r} is not supported "
                             f"(supported: Llama, Mistral, Qwen2, Qwen3)")
        if cfg.get("sliding_window") and cfg.get("use_sliding_window", arch == "llama"):
            raise ValueError("model: sliding-window attention is not supported yet by this engine")
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
            bos_token_id=cfg.get("bos_token_id"), name=name)

    @property
    def kv_bytes_per_token_fp32(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 4
