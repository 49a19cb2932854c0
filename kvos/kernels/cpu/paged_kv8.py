"""8-bit paged KV caches (int8, fp8 e4m3) on the CPU (``paged_kv8.c``): the quantizing write and
the decode attention, numbers as ``kvos.kernels.kv_quant`` defines them."""
from __future__ import annotations

import ctypes

import torch

from kvos.kernels.cpu.build import library

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


class Kv8View(ctypes.Structure):
    """One layer's 8-bit cache as the C kernels read it: K and V bytes with their element strides
    (V may be token-minor), the float32 scales with the strides both share, and the format.
    Only valid while the tensors it was made from live (it holds their addresses)."""

    _fields_ = [("k", _ptr), ("v", _ptr), ("k_scale", _ptr), ("v_scale", _ptr),
                ("ksb", _i64), ("kst", _i64), ("ksh", _i64), ("ksd", _i64),
                ("vsb", _i64), ("vst", _i64), ("vsh", _i64), ("vsd", _i64),
                ("ssb", _i64), ("sst", _i64), ("ssh", _i64), ("fp8", _i64)]


def view_of(k: torch.Tensor, v: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor) -> Kv8View | None:
    """The C view of a quantized layer cache (``KVCache`` fields), or None when the kernels are
    not built or the cache is not one they take: K and V both int8 or both float8_e4m3fn on the
    CPU, float32 scales ``[blocks, block_size, kv_heads]`` of equal strides."""
    if (library() is None or k.device.type != "cpu" or k.dtype != v.dtype
            or k.dtype not in (torch.int8, torch.float8_e4m3fn) or k.shape != v.shape
            or k_scale.dtype != torch.float32 or k_scale.shape != k.shape[:3]
            or k_scale.stride() != v_scale.stride()):
        return None
    return Kv8View(k.data_ptr(), v.data_ptr(), k_scale.data_ptr(), v_scale.data_ptr(), *k.stride(), *v.stride(),
                   *k_scale.stride(), int(k.dtype == torch.float8_e4m3fn))


def write_kv8(k: torch.Tensor, v: torch.Tensor, view: Kv8View, slot_mapping: torch.Tensor,
              block_size: int) -> None:
    """Token t's k/v ``[T, KVH, D]`` float32 (row-strided views allowed) quantized into flat slot
    ``slot_mapping[t]`` of the cache ``view`` describes, with their scales; slot -1 is skipped.
    Slots must be distinct, lie inside the cache (unchecked) and belong to blocks only this step's
    sequences write."""
    t, heads, dim = k.shape
    slots = slot_mapping.to(torch.int64).contiguous()
    rows = []
    for x in (k, v):
        if x.dtype != torch.float32:
            x = x.float()
        if x.stride(2) != 1 or x.stride(1) != dim:
            x = x.contiguous()
        rows.append(x)
    library().paged_write_kv8(rows[0].data_ptr(), rows[1].data_ptr(), t, heads, dim, rows[0].stride(0),
                              rows[1].stride(0), ctypes.byref(view), slots.data_ptr(), block_size,
                              torch.get_num_threads())


def decode_attention_kv8(q: torch.Tensor, view: Kv8View, num_kv_heads: int, block_size: int,
                         block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                         window: int | None = None) -> torch.Tensor:
    """q ``[n, H, D]`` float32 (one query per sequence, at position ``seq_lens[i] - 1``; D a
    multiple of 8) over the cache ``view`` describes; ``block_tables`` ``[n, max_blocks]``,
    ``seq_lens`` ``[n]``. Query i attends its keys at positions ``seq_lens[i] - window ..
    seq_lens[i] - 1`` (all without a window), dequantized as ``kv_quant.dequantize``. Only safe
    while the blocks in ``block_tables`` are referenced."""
    n, heads, dim = q.shape
    q = q.contiguous()
    out = torch.empty_like(q)
    if n == 0:
        return out
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    library().paged_decode_attention_kv8(
        q.data_ptr(), n, heads, num_kv_heads, dim, ctypes.byref(view), tables.data_ptr(), tables.stride(0),
        lens.data_ptr(), block_size, window or 0, scale, out.data_ptr(), torch.get_num_threads())
    return out
