"""A GGUF file's header read into a ``ModelConfig`` (what the file records, and llama.cpp's
conventions where it records nothing)."""
from __future__ import annotations

from pathlib import Path

from kvos.models.config import SUPPORTED_ARCHS, ModelConfig

GEMMA3_SLIDING_PATTERN = 6
"""llama.cpp's gemma3 (``set_swa_pattern(6)``) and transformers' default: every 6th layer is full;
GGUF files do not record it."""
GEMMA3_LOCAL_ROPE_BASE = 10_000.0
"""The sliding layers' rotary base (llama.cpp's ``rope_freq_base_train_swa``); not in the file."""


def open_gguf(path: Path):
    try:
        from gguf import GGUFReader
    except ImportError as e:  # pragma: no cover - gguf is a declared dependency
        raise ImportError("loading GGUF files needs the `gguf` package: pip install gguf") from e
    try:
        return GGUFReader(str(path))
    except Exception as e:
        raise ValueError(f"model: {path} is not a valid GGUF file ({type(e).__name__}: {e})") from e


def field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def read_gguf_config(reader, path: Path) -> ModelConfig:
    arch_name = field(reader, "general.architecture")
    if arch_name not in SUPPORTED_ARCHS or arch_name == "gemma3_text":
        raise ValueError(f"model: GGUF architecture {arch_name!r} is not supported "
                         f"(supported: llama, mistral, qwen2, qwen3, gemma3)")
    a = arch_name
    heads = int(field(reader, f"{a}.attention.head_count"))
    hidden = int(field(reader, f"{a}.embedding_length"))
    key_len = field(reader, f"{a}.attention.key_length")
    names = {t.name for t in reader.tensors}
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    eos = field(reader, "tokenizer.ggml.eos_token_id")
    rope_scaling = None
    scaling_type = field(reader, f"{a}.rope.scaling.type")
    if scaling_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(field(reader, f"{a}.rope.scaling.factor"))}
    elif scaling_type not in (None, "none"):
        raise ValueError(f"model: rope scaling {scaling_type!r} in GGUF is not supported")
    layers = int(field(reader, f"{a}.block_count"))
    extra = {}
    if a == "gemma3":
        # llama.cpp's attention scale: 1/sqrt(hidden/heads) for the 27B (62 layers), else
        # 1/sqrt(head_dim); transformers reads these files with query_pre_attn_scalar = 256.
        head_dim = int(key_len) if key_len else hidden // heads
        extra = dict(
            sliding_window=int(field(reader, f"{a}.attention.sliding_window")),
            layer_types=["sliding_attention" if (i + 1) % GEMMA3_SLIDING_PATTERN else "full_attention"
                         for i in range(layers)],
            rope_local_theta=GEMMA3_LOCAL_ROPE_BASE,
            query_pre_attn_scalar=hidden // heads if layers == 62 else head_dim)
    return ModelConfig(
        arch=SUPPORTED_ARCHS[a], hidden_size=hidden, num_layers=layers,
        num_heads=heads, num_kv_heads=int(field(reader, f"{a}.attention.head_count_kv", heads)),
        head_dim=int(key_len) if key_len else hidden // heads,
        intermediate_size=int(field(reader, f"{a}.feed_forward_length")),
        vocab_size=int(field(reader, f"{a}.vocab_size", embd.shape[-1])),
        rms_norm_eps=float(field(reader, f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(field(reader, f"{a}.rope.freq_base", 10000.0)), rope_scaling=rope_scaling,
        max_position_embeddings=int(field(reader, f"{a}.context_length", 4096)),
        tie_word_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names, qk_norm="blk.0.attn_q_norm.weight" in names,
        eos_token_ids=[int(eos)] if eos is not None else [],
        bos_token_id=field(reader, "tokenizer.ggml.bos_token_id"), name=path.name, **extra)
