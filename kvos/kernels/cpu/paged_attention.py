"""Decode attention over a paged float32 KV cache on the CPU (``paged_attention.c``)."""
from __future__ import annotations

import torch

from kvos.kernels.cpu.build import library


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether ``decode_attention`` takes these: float32 on the CPU, K and V of one layout with
    contiguous head rows, a head size that is a multiple of 8, and the kernels built."""
    return (q.device.type == "cpu" and q.dtype == k.dtype == v.dtype == torch.float32
            and k.stride() == v.stride() and k.stride(-1) == 1 and q.shape[-1] % 8 == 0
            and library() is not None)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, window: int | None = None) -> torch.Tensor:
    """q ``[n, H, D]`` (one query per sequence, at position ``seq_lens[i] - 1``); k, v ``[blocks,
    block_size, KVH, D]``; ``block_tables`` ``[n, max_blocks]`` int32; ``seq_lens`` ``[n]`` int32.
    Query i attends its keys at positions ``seq_lens[i] - window .. seq_lens[i] - 1`` (all
    without a window). Only safe while the blocks in ``block_tables`` are referenced (the
    kernel reads them without bounds checks). Needs ``supports(q, k, v)``."""
    n, heads, dim = q.shape
    q = q.contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    out = torch.empty_like(q)
    if n == 0:
        return out
    library().paged_decode_attention(
        q.data_ptr(), n, heads, k.shape[2], dim, k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1),
        k.stride(2), tables.data_ptr(), tables.stride(0), lens.data_ptr(), k.shape[1], window or 0, scale,
        out.data_ptr(), torch.get_num_threads())
    return out


def write_kv(k: torch.Tensor, v: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Token t's k/v ``[T, KVH, D]`` (row-strided views allowed) into flat slot
    ``slot_mapping[t]`` of ``cache_k``/``cache_v`` (``[blocks, block_size, KVH, D]``); slot -1 is
    skipped. Slots must lie inside the caches (unchecked) and belong to blocks only this step's
    sequences write. Needs ``supports(k, cache_k, cache_v)``."""
    slots = slot_mapping.to(torch.int64).contiguous()
    t, heads, dim = k.shape
    for x, cache in ((k, cache_k), (v, cache_v)):
        if x.stride(2) != 1 or x.stride(1) != dim:
            x = x.contiguous()
        library().paged_write(x.data_ptr(), t, heads, dim, x.stride(0), cache.data_ptr(), cache.stride(0),
                              cache.stride(1), cache.stride(2), slots.data_ptr(), cache.shape[1])
