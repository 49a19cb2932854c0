"""Read a GGUF file into a ModelConfig and HF-named float tensors."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

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


def _hf_tensors(index, data: np.ndarray):
    """(HF name, GGUF entry, raw bytes or values as stored) of each tensor kvos loads."""
    layer_names = _GEMMA3_LAYER_NAMES if index.arch == "gemma3" else _LAYER_NAMES
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
        yield name, t, np.ndarray(t.shape, dtype=np.dtype(t.dtype), buffer=data, offset=t.offset)


def _rotary_heads(index, gguf_name: str) -> int | None:
    """Heads of a q/k tensor that llama.cpp stored with its rotary row permutation, else None."""
    if index.arch not in ("llama", "mistral") or kind_of(gguf_name) not in ("attn_q", "attn_k"):
        return None
    return index.config.num_heads if kind_of(gguf_name) == "attn_q" else index.config.num_kv_heads


def load_gguf(path: str | Path) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Config and dequantized float32 weights keyed by HF parameter names, in HF's convention:
    llama/mistral q/k rows un-permuted; gemma3 norm weights, which llama.cpp stores as ``1 + w``,
    returned as ``w`` (``stored - 1``, as transformers' GGUF loader does; the model adds 1 back)."""
    from gguf import GGMLQuantizationType

    from kvos.models.gguf_dequant import dequantize

    path = Path(path)
    index = gguf_index(path)
    weights: dict[str, np.ndarray] = {}
    for name, t, raw in _hf_tensors(index, np.memmap(path, mode="r")):
        try:
            w = dequantize(raw, GGMLQuantizationType(t.ggml_type))
        except Exception as e:
            raise ValueError(f"model: tensor {t.name} of {path} cannot be read ({e})") from e
        heads = _rotary_heads(index, t.name)
        if heads is not None:
            w = _unpermute(w, heads)
        if index.arch == "gemma3" and t.name.endswith("norm.weight"):
            w = w - np.float32(1.0)
        weights[name] = w
    return index.config, weights


def load_gguf_blocks(path: str | Path) -> dict:
    """The 2-D weights stored in a block format the CPU kernels take (``gguf_blocks``), keyed by
    HF name, rows in HF's order (q/k un-permuted as in ``load_gguf``); others are left out."""
    from gguf import GGMLQuantizationType

    from kvos.models.gguf_blocks import block_weight

    path = Path(path)
    index = gguf_index(path)
    blocks = {}
    for name, t, raw in _hf_tensors(index, np.memmap(path, mode="r")):
        w = block_weight(raw, GGMLQuantizationType(t.ggml_type)) if name.endswith(".weight") else None
        if w is None:
            continue
        heads = _rotary_heads(index, t.name)
        if heads is not None:
            w = w.rows(torch.from_numpy(_unpermute(np.arange(w.shape[0]), heads)))
        blocks[name] = w
    return blocks


def kind_of(gguf_name: str) -> str:
    parts = gguf_name.split(".")
    return parts[2] if len(parts) == 4 and parts[0] == "blk" else ""
