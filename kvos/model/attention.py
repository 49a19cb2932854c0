"""Paged attention: the backend interface and the torch reference implementation."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from kvos.model.kv_quant import dequantize, kv_dtype_of, quantize


@dataclass
class AttentionMetadata:
    """Where this step's tokens go and what they attend to.

    Sequences are ordered decodes first (one query token each), then prefill chunks.
    ``slot_mapping[t]`` is the flat cache slot (``block_id * block_size + offset``) of token t
    (int64; -1 marks a padding row whose K/V is not written).
    ``block_tables[i]`` (int32) lists sequence i's blocks, padded with the null block 0;
    ``seq_lens[i]`` (int32) counts its tokens after this step (cached prefix plus new tokens);
    ``query_lens[i]`` counts its new tokens. Python lists mirror the tensors for per-sequence
    loops (empty inside a CUDA graph, whose steps are decode-only).
    ``prefill_start_loc`` (int32, ``num_prefills + 1``): offsets of each prefill's rows counted
    from the first prefill row; ``max_prefill_len`` the longest prefill chunk.
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_lens_list: list[int]
    seq_lens_list: list[int]
    num_decodes: int
    block_size: int
    prefill_start_loc: torch.Tensor | None = None
    max_prefill_len: int = 0


class KVCache(NamedTuple):
    """One layer's paged K and V: ``k``, ``v`` ``[num_blocks, block_size, kv_heads, head_dim]``
    (any strides: views into a page-major pool). A quantized cache (fp8 / int8 storage) has
    float32 scales ``k_scale``, ``v_scale`` ``[num_blocks, block_size, kv_heads]`` beside them
    (``kvos.model.kv_quant``); the model's own dtype has none."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None


class AttentionBackend(ABC):
    """Writes new K/V into the paged cache, then attends over each sequence's blocks.

    Safety rule: the blocks named by ``block_tables`` must be referenced by their sequences for
    the whole step; slots in ``slot_mapping`` belong to blocks no other sequence writes this step.
    With a ``window``, table entries of blocks wholly before every query's window may be the
    null block (0): they are never needed for the result.
    """

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache,
                meta: AttentionMetadata, scale: float, window: int | None = None) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D]; cache: the layer's paged K/V (quantized on write
        when it has scales; attention then reads the dequantized values, its own new tokens'
        included). A query at position p attends keys at positions ``p - window < j <= p`` (all
        ``j <= p`` without a window). Returns [T, H, D]."""


def write_kv(k: torch.Tensor, v: torch.Tensor, cache: KVCache, slot_mapping: torch.Tensor) -> None:
    """Token t's K/V into flat slot ``slot_mapping[t]`` (quantized, with its scales, when the
    cache is)."""
    bs = cache.k.shape[1]
    blocks, offsets = slot_mapping // bs, slot_mapping % bs
    for x, data, scales in ((k, cache.k, cache.k_scale), (v, cache.v, cache.v_scale)):
        if scales is None:
            data[blocks, offsets] = x.to(data.dtype)
        else:
            data[blocks, offsets], scales[blocks, offsets] = quantize(x, kv_dtype_of(data.dtype))


def gather_kv(data: torch.Tensor, scales: torch.Tensor | None, index: torch.Tensor,
              dtype: torch.dtype) -> torch.Tensor:
    """``data[index]`` in ``dtype``, dequantized when ``scales`` is given."""
    if scales is None:
        return data[index].to(dtype)
    return dequantize(data[index], scales[index], dtype)


class TorchReferenceBackend(AttentionBackend):
    """Gathers each sequence's K/V through its block table and calls SDPA.

    Decodes run in padded groups of similar length with a length mask; each prefill chunk runs
    alone with a causal mask offset by its cached prefix. The numerical oracle for other backends.
    """

    def forward(self, q, k, v, cache, meta, scale, window=None):
        write_kv(k, v, cache, meta.slot_mapping)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            out[:nd] = self._decode(q[:nd], cache, meta, scale, window)
        t = nd
        for i in range(nd, len(meta.query_lens_list)):
            n, ctx = meta.query_lens_list[i], meta.seq_lens_list[i]
            out[t : t + n] = self._prefill(q[t : t + n], cache, meta.block_tables[i], ctx,
                                           meta.block_size, scale, window)
            t += n
        return out

    DECODE_GROUP = 16
    """Decodes are padded per group of this many sequences of similar length, not to the
    longest context of the whole batch."""

    def _decode(self, q, cache: KVCache, meta: AttentionMetadata, scale: float,
                window: int | None) -> torch.Tensor:
        nd = q.shape[0]
        lens = meta.seq_lens_list[:nd]
        order = sorted(range(nd), key=lens.__getitem__)
        out = torch.empty_like(q)
        for g in range(0, nd, self.DECODE_GROUP):
            rows = order[g : g + self.DECODE_GROUP]
            idx = torch.tensor(rows, device=q.device)
            out[idx] = self._decode_group(q[idx], cache, meta.block_tables[idx],
                                          meta.seq_lens[idx], lens[rows[-1]], meta.block_size, scale,
                                          window)
        return out

    @staticmethod
    def _decode_group(q, cache: KVCache, tables, seq_lens, max_len: int, block_size: int,
                      scale: float, window: int | None = None) -> torch.Tensor:
        n = q.shape[0]
        nb = -(-max_len // block_size)
        tables = tables[:, :nb]
        kvh, d = cache.k.shape[2], cache.k.shape[3]
        keys = gather_kv(cache.k, cache.k_scale, tables, q.dtype).reshape(n, nb * block_size, kvh, d).transpose(1, 2)
        values = gather_kv(cache.v, cache.v_scale, tables, q.dtype).reshape(n, nb * block_size, kvh, d).transpose(1, 2)
        pos = torch.arange(nb * block_size, device=q.device)
        mask = pos[None, :] < seq_lens[:, None]
        if window:
            mask &= pos[None, :] >= seq_lens[:, None] - window
        if cache.quantized:  # slots past a sequence's end hold a reused page's bytes: NaN or inf as fp8
            keep = mask[:, None, :, None]
            keys, values = keys.masked_fill(~keep, 0), values.masked_fill(~keep, 0)
        mask = mask.view(n, 1, 1, -1)
        o = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values,
                                           attn_mask=mask, scale=scale, enable_gqa=True)
        return o.squeeze(2)

    @staticmethod
    def _prefill(q, cache: KVCache, table, ctx: int, block_size: int, scale: float,
                 window: int | None = None) -> torch.Tensor:
        n = q.shape[0]
        nb = -(-ctx // block_size)
        kvh, d = cache.k.shape[2], cache.k.shape[3]
        keys = gather_kv(cache.k, cache.k_scale, table[:nb], q.dtype).reshape(-1, kvh, d)[:ctx].transpose(0, 1).unsqueeze(0)
        values = gather_kv(cache.v, cache.v_scale, table[:nb], q.dtype).reshape(-1, kvh, d)[:ctx].transpose(0, 1).unsqueeze(0)
        qh = q.transpose(0, 1).unsqueeze(0)
        if window and window < ctx:
            qpos = torch.arange(ctx - n, ctx, device=q.device)[:, None]
            kpos = torch.arange(ctx, device=q.device)[None, :]
            mask = (kpos <= qpos) & (kpos > qpos - window)
            o = F.scaled_dot_product_attention(qh, keys, values,
                                               attn_mask=mask, scale=scale, enable_gqa=True)
        elif n == ctx:
            o = F.scaled_dot_product_attention(qh, keys, values,
                                               is_causal=True, scale=scale, enable_gqa=True)
        else:
            qpos = torch.arange(ctx - n, ctx, device=q.device)
            mask = qpos[:, None] >= torch.arange(ctx, device=q.device)[None, :]
            o = F.scaled_dot_product_attention(qh, keys, values,
                                               attn_mask=mask, scale=scale, enable_gqa=True)
        return o.squeeze(0).transpose(0, 1)
