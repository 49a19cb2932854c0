"""A Llama decoder's layers for a step of decodes in one C call (``decoder_layers.c``): the
kernels the Python path calls per operation, called from C, so a decode step pays one Python
call for every layer instead of about seventy.

``DecodeLayers`` holds the layers' weights and caches as C structures, built once per model and
cache set; ``run`` takes a step's rows. The result equals the Python path's (the same kernels on
the same values) except SiLU's exp, which is the C library's here and torch's there (last-bit
differences)."""
from __future__ import annotations

import ctypes

import torch

from kvos.kernels.cpu.build import library
from kvos.kernels.cpu.quant_matmul import BlockQuantWeight

_i64, _ptr, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float


class _BlockWeight(ctypes.Structure):
    _fields_ = [("q", _ptr), ("d", _ptr), ("m", _ptr), ("n", _i64)]


class _DecodeLayer(ctypes.Structure):
    _fields_ = [("qkv", _BlockWeight), ("o", _BlockWeight), ("gate_up", _BlockWeight), ("down", _BlockWeight),
                ("input_norm", _ptr), ("post_norm", _ptr), ("k_cache", _ptr), ("v_cache", _ptr),
                ("window", _i64), ("kv8", _ptr)]


class _DecodeShape(ctypes.Structure):
    _fields_ = [("hidden", _i64), ("heads", _i64), ("kv_heads", _i64), ("head_dim", _i64),
                ("intermediate", _i64), ("block_size", _i64), ("cache_sb", _i64), ("cache_st", _i64),
                ("cache_sh", _i64), ("table_stride", _i64), ("eps", _f32), ("scale", _f32)]


def _weight(w: BlockQuantWeight) -> _BlockWeight:
    return _BlockWeight(w.q.data_ptr(), w.d.data_ptr(), 0 if w.m is None else w.m.data_ptr(), w.shape[0])


class DecodeLayers:
    """The C view of ``layers`` (``(qkv, o, gate_up, down, input_norm, post_norm, k_cache,
    v_cache, window, kv8)`` per layer: block weights, float32 norm weights ``[hidden]``, float32
    caches ``[blocks, block_size, kv_heads, head_dim]`` of one layout, or with ``kv8`` (a
    ``paged_kv8.Kv8View``, else None) an 8-bit cache that it describes). Only valid while those
    tensors live and keep their storage (the structures hold their addresses)."""

    def __init__(self, layers: list[tuple], hidden: int, heads: int, kv_heads: int, head_dim: int,
                 intermediate: int, eps: float, scale: float) -> None:
        self._keep = layers
        k0 = layers[0][6]
        self.shape = _DecodeShape(hidden, heads, kv_heads, head_dim, intermediate, k0.shape[1], k0.stride(0),
                                  k0.stride(1), k0.stride(2), 0, eps, scale)
        self.layers = (_DecodeLayer * len(layers))(*(
            _DecodeLayer(_weight(qkv), _weight(o), _weight(gu), _weight(down), n1.data_ptr(), n2.data_ptr(),
                         k.data_ptr(), v.data_ptr(), window or 0, ctypes.addressof(kv8) if kv8 is not None else 0)
            for qkv, o, gu, down, n1, n2, k, v, window, kv8 in layers))
        s = self.shape
        self._scratch_per_row = 2 * s.hidden + 2 * (heads + 2 * kv_heads) * head_dim + 3 * intermediate

    def run(self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor,
            seq_lens: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x ``[M, hidden]`` float32 (the embeddings of M decode rows, one per sequence; not
        modified) → (the last layer's MLP output, the residual stream before it). positions,
        slots ``[M]``; tables ``[M, width]`` and seq_lens ``[M]`` (after this token) as the
        attention metadata holds them; cos/sin the rotary tables. Only safe while the tables'
        blocks are referenced and the slots belong to blocks only these sequences write."""
        m = x.shape[0]
        out = x.contiguous().clone()
        residual = torch.empty_like(out)
        tables = tables.to(torch.int32).contiguous()
        self.shape.table_stride = tables.stride(0)
        scratch = torch.empty(m * self._scratch_per_row, dtype=torch.float32)
        positions = positions.to(torch.int64).contiguous()
        slots = slots.to(torch.int64).contiguous()
        lens = seq_lens.to(torch.int32).contiguous()
        library().llama_decode_layers(
            ctypes.addressof(self.layers), len(self.layers), ctypes.addressof(self.shape), out.data_ptr(), residual.data_ptr(), m,
            positions.data_ptr(), slots.data_ptr(), tables.data_ptr(), lens.data_ptr(), cos.data_ptr(),
            sin.data_ptr(), scratch.data_ptr(), torch.get_num_threads())
        return out, residual
