"""Read a GGUF file into a ModelConfig and HF-named float tensors."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from kvos.model.config import SUPPORTED_ARCHS, ModelConfig

_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GEMMA3_LAYER_NAMES = {
    **_LAYER_NAMES, "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
}
"""llama.cpp's gemma3 tensors: ``ffn_norm`` is the pre-feedforward norm there."""
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                 "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
GEMMA3_SLIDING_PATTERN = 6
"""llama.cpp's gemma3 (``set_swa_pattern(6)``) and transformers' default: every 6th layer is full;
GGUF files do not record it."""
GEMMA3_LOCAL_ROPE_BASE = 10_000.0
"""The sliding layers' rotary base (llama.cpp's ``rope_freq_base_train_swa``); not in the file."""


def _open(path: Path):
    try:
        from gguf import GGUFReader
    except ImportError as e:  # pragma: no cover - gguf is a declared dependency
        raise ImportError("loading GGUF files needs the `gguf` package: pip install gguf") from e
    try:
        return GGUFReader(str(path))
    except Exception as e:
        raise ValueError(f"model: {path} is not a valid GGUF file ({type(e).__name__}: {e})") from e


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def read_gguf_config(reader, path: Path) -> ModelConfig:
    arch_name = _field(reader, "general.architecture")
    if arch_name not in SUPPORTED_ARCHS or arch_name == "gemma3_text":
        raise ValueError(f"model: GGUF architecture {arch_name!r} is not supported "
                         f"(supported: llama, mistral, qwen2, qwen3, gemma3)")
    a = arch_name
    heads = int(_field(reader, f"{a}.attention.head_count"))
    hidden = int(_field(reader, f"{a}.embedding_length"))
    key_len = _field(reader, f"{a}.attention.key_length")
    names = {t.name for t in reader.tensors}
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    rope_scaling = None
    scaling_type = _field(reader, f"{a}.rope.scaling.type")
    if scaling_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(_field(reader, f"{a}.rope.scaling.factor"))}
    elif scaling_type not in (None, "none"):
        raise ValueError(f"model: rope scaling {scaling_type!r} in GGUF is not supported")
    layers = int(_field(reader, f"{a}.block_count"))
    extra = {}
    if a == "gemma3":
        # llama.cpp's attention scale: 1/sqrt(hidden/heads) for the 27B (62 layers), else
        # 1/sqrt(head_dim); transformers reads these files with query_pre_attn_scalar = 256.
        head_dim = int(key_len) if key_len else hidden // heads
        extra = dict(
            sliding_window=int(_field(reader, f"{a}.attention.sliding_window")),
            layer_types=["sliding_attention" if (i + 1) % GEMMA3_SLIDING_PATTERN else "full_attention"
                         for i in range(layers)],
            rope_local_theta=GEMMA3_LOCAL_ROPE_BASE,
            query_pre_attn_scalar=hidden // heads if layers == 62 else head_dim)
    return ModelConfig(
        arch=SUPPORTED_ARCHS[a], hidden_size=hidden, num_layers=layers,
        num_heads=heads, num_kv_heads=int(_field(reader, f"{a}.attention.head_count_kv", heads)),
        head_dim=int(key_len) if key_len else hidden // heads,
        intermediate_size=int(_field(reader, f"{a}.feed_forward_length")),
        vocab_size=int(_field(reader, f"{a}.vocab_size", embd.shape[-1])),
        rms_norm_eps=float(_field(reader, f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(_field(reader, f"{a}.rope.freq_base", 10000.0)), rope_scaling=rope_scaling,
        max_position_embeddings=int(_field(reader, f"{a}.context_length", 4096)),
        tie_word_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names, qk_norm="blk.0.attn_q_norm.weight" in names,
        eos_token_ids=[int(eos)] if eos is not None else [],
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"), name=path.name, **extra)


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary row permutation of attn_q/attn_k (weights and biases)."""
    d_out = w.shape[0]
    rest = w.shape[1:]
    return w.reshape(n_heads, d_out // n_heads // 2, 2, *rest).swapaxes(1, 2).reshape(d_out, *rest)


def load_gguf(path: str | Path) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Config and dequantized float32 weights keyed by HF parameter names, in HF's convention:
    llama/mistral q/k rows un-permuted; gemma3 norm weights, which llama.cpp stores as ``1 + w``,
    returned as ``w`` (``stored - 1``, as transformers' GGUF loader does; the model adds 1 back)."""
    from gguf import GGMLQuantizationType

    from kvos.model.gguf_dequant import dequantize
    from kvos.model.gguf_index import gguf_index

    path = Path(path)
    index = gguf_index(path)
    cfg, arch = index.config, index.arch
    data = np.memmap(path, mode="r")
    permuted = arch in ("llama", "mistral")
    layer_names = _GEMMA3_LAYER_NAMES if arch == "gemma3" else _LAYER_NAMES
    weights: dict[str, np.ndarray] = {}
    for t in index.tensors:
        m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", t.name)
        if m:
            layer, kind, suffix = m.groups()
            if kind not in layer_names:
                continue
            name = f"model.layers.{layer}.{layer_names[kind]}.{suffix}"
        elif t.name in _GLOBAL_NAMES:
            name = _GLOBAL_NAMES[t.name]
        else:
            continue
        try:
            raw = np.ndarray(t.shape, dtype=np.dtype(t.dtype), buffer=data, offset=t.offset)
            w = dequantize(raw, GGMLQuantizationType(t.ggml_type))
        except Exception as e:
            raise ValueError(f"model: tensor {t.name} of {path} cannot be read ({e})") from e
        if permuted and kind_of(t.name) in ("attn_q", "attn_k"):
            w = _unpermute(w, cfg.num_heads if kind_of(t.name) == "attn_q" else cfg.num_kv_heads)
        if arch == "gemma3" and t.name.endswith("norm.weight"):
            w = w - np.float32(1.0)
        weights[name] = w
    return cfg, weights


def kind_of(gguf_name: str) -> str:
    parts = gguf_name.split(".")
    return parts[2] if len(parts) == 4 and parts[0] == "blk" else ""
