"""Reused segment KV into a request's slots, keys re-rotated to their new positions.

RoPE rotates each pair of a key's dimensions by ``position * inv_freq``; rotations compose, so
a key stored at position ``p`` becomes the key of position ``p + delta`` when rotated by
``delta * inv_freq``: ``k' = k cos(delta w) + rotate_half(k) sin(delta w)``, with the layer's
own table (Llama 3 scaling, Gemma's local and global bases). Values carry no position. Only
for caches in the model's dtype (the engine refuses segment reuse with a quantized KV cache).
"""
from __future__ import annotations

import torch

from kvos.core.step import SegmentCopy
from kvos.models.attention import KVCache
from kvos.worker.host_copies import to_device


def rotate_keys(k: torch.Tensor, delta: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Keys ``k`` ``[n, kv_heads, head_dim]`` rotated forward by ``delta[i]`` positions each, in
    float32 (``cos``/``sin``: the layer's float32 ``[max_pos, head_dim]`` tables)."""
    c, s = cos[delta].unsqueeze(1), sin[delta].unsqueeze(1)
    x = k.float()
    h = x.shape[-1] // 2
    rotated = torch.cat((-x[..., h:], x[..., :h]), dim=-1)
    return (x * c + rotated * s).to(k.dtype)


def apply_segment_copies(copies: list[SegmentCopy], kv_layers: list[KVCache], layer_group: list[int],
                         rotary_of, block_size: int) -> None:
    """Run a step's ``copies`` for every layer: one gather, rotation and scatter per layer and
    group. ``rotary_of(layer)`` gives the layer's table (``cos``, ``sin``). Sources and
    destinations are distinct slots (a source is a cached block the request borrows; a
    destination its own fresh block), so the order of copies does not matter."""
    if not copies:
        return
    device = kv_layers[0].k.device
    for g in sorted({c.group for c in copies}):
        mine = [c for c in copies if c.group == g]
        src = to_device([s for c in mine for s in c.src_slots], torch.long, device)
        dst = to_device([d for c in mine for d in c.dst_slots], torch.long, device)
        delta = to_device([c.delta for c in mine for _ in c.src_slots], torch.long, device)
        sb, so, db, do = src // block_size, src % block_size, dst // block_size, dst % block_size
        for layer, cache in enumerate(kv_layers):
            if layer_group[layer] != g:
                continue
            if cache.quantized:
                raise ValueError("segment reuse needs a KV cache in the model's dtype (kv_cache_dtype auto)")
            rope = rotary_of(layer)
            cache.k[db, do] = rotate_keys(cache.k[sb, so], delta, rope.cos, rope.sin)
            cache.v[db, do] = cache.v[sb, so]
