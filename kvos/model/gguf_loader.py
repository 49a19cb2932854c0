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
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                 "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}


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
    if arch_name not in SUPPORTED_ARCHS:
        raise ValueError(f"model: GGUF architecture {arch_name!r} is not supported "
                         f"(supported: llama, mistral, qwen2, qwen3)")
    a = arch_name
    heads = int(_field(reader, f"{a}.attention.head_count"))
    hidden = int(_field(reader, f"{a}.embedding_length"))
    key_len = _field(reader, f"{a}.attention.key_length")
    names = {t.name for t in reader.tensors}
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    rope_scaling = None
    if _field(reader, f"{a}.rope.scaling.type") not in (None, "none"):
        raise ValueError(f"model: rope scaling {_field(reader, f'{a}.rope.scaling.type')!r} in GGUF is not supported")
    return ModelConfig(
        arch=SUPPORTED_ARCHS[a], hidden_size=hidden, num_layers=int(_field(reader, f"{a}.block_count")),
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
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"), name=path.name)


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary row permutation of attn_q/attn_k (weights and biases)."""
    d_out = w.shape[0]
    rest = w.shape[1:]
    return w.reshape(n_heads, d_out // n_heads // 2, 2, *rest).swapaxes(1, 2).reshape(d_out, *rest)


def load_gguf(path: str | Path) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Config and dequantized float32 weights keyed by HF parameter names."""
    from gguf.quants import dequantize

    path = Path(path)
    reader = _open(path)
    cfg = read_gguf_config(reader, path)
    permuted = _field(reader, "general.architecture") in ("llama", "mistral")
    weights: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", t.name)
        if m:
            layer, kind, suffix = m.groups()
            if kind not in _LAYER_NAMES:
                continue
            name = f"model.layers.{layer}.{_LAYER_NAMES[kind]}.{suffix}"
        elif t.name in _GLOBAL_NAMES:
            name = _GLOBAL_NAMES[t.name]
        else:
            continue
        try:
            w = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)
        except Exception as e:
            raise ValueError(f"model: tensor {t.name} of {path} cannot be read ({e})") from e
        if permuted and kind_of(t.name) in ("attn_q", "attn_k"):
            w = _unpermute(w, cfg.num_heads if kind_of(t.name) == "attn_q" else cfg.num_kv_heads)
        weights[name] = w
    return cfg, weights


def kind_of(gguf_name: str) -> str:
    parts = gguf_name.split(".")
    return parts[2] if len(parts) == 4 and parts[0] == "blk" else ""
