"""Read a GGUF file into a ModelConfig and HF-named float tensors."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from kvos.models.config import ModelConfig
from kvos.models.gguf_index import gguf_index

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

    from kvos.models.gguf_dequant import dequantize

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
