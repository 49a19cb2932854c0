"""Paged attention: the backend interface and the torch reference implementation."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F


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


KVCache = tuple[torch.Tensor, torch.Tensor]
"""One layer's K and V caches, each ``[num_blocks, block_size, kv_heads, head_dim]`` (any strides)."""


class AttentionBackend(ABC):
    """Writes new K/V into the paged cache, then attends over each sequence's blocks.

    Safety rule: the blocks named by ``block_tables`` must be referenced by their sequences for
    the whole step; slots in ``slot_mapping`` belong to blocks no other sequence writes this step.
    With a ``window``, table entries of blocks wholly before every query's window may be the
    null block (0): they are never needed for the result.
    """

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float, window: int | None = None) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D]; caches: [num_blocks, block_size, KVH, D] (any
        strides: a layer's view into a page-major pool). A query at position p attends keys at
        positions ``p - window < j <= p`` (all ``j <= p`` without a window). Returns [T, H, D]."""


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    bs = k_cache.shape[1]
    blocks, offsets = slot_mapping // bs, slot_mapping % bs
    k_cache[blocks, offsets] = k.to(k_cache.dtype)
    v_cache[blocks, offsets] = v.to(v_cache.dtype)


class TorchReferenceBackend(AttentionBackend):
    """Gathers each sequence's K/V through its block table and calls SDPA.

    Decodes run in padded groups of similar length with a length mask; each prefill chunk runs
    alone with a causal mask offset by its cached prefix. The numerical oracle for other backends.
    """

    def forward(self, q, k, v, k_cache, v_cache, meta, scale, window=None):
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            out[:nd] = self._decode(q[:nd], k_cache, v_cache, meta, scale, window)
        t = nd
        for i in range(nd, len(meta.query_lens_list)):
            n, ctx = meta.query_lens_list[i], meta.seq_lens_list[i]
            out[t : t + n] = self._prefill(q[t : t + n], k_cache, v_cache, meta.block_tables[i], ctx,
                                           meta.block_size, scale, window)
            t += n
        return out

    DECODE_GROUP = 16
    """Decodes are padded per group of this many sequences of similar length, not to the
    longest context of the whole batch."""

    def _decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                window: int | None) -> torch.Tensor:
        nd = q.shape[0]
        lens = meta.seq_lens_list[:nd]
        order = sorted(range(nd), key=lens.__getitem__)
        out = torch.empty_like(q)
        for g in range(0, nd, self.DECODE_GROUP):
            rows = order[g : g + self.DECODE_GROUP]
            idx = torch.tensor(rows, device=q.device)
            out[idx] = self._decode_group(q[idx], k_cache, v_cache, meta.block_tables[idx],
                                          meta.seq_lens[idx], lens[rows[-1]], meta.block_size, scale,
                                          window)
        return out

    @staticmethod
    def _decode_group(q, k_cache, v_cache, tables, seq_lens, max_len: int, block_size: int,
                      scale: float, window: int | None = None) -> torch.Tensor:
        n = q.shape[0]
        nb = -(-max_len // block_size)
        tables = tables[:, :nb]
        kvh, d = k_cache.shape[2], k_cache.shape[3]
        keys = k_cache[tables].reshape(n, nb * block_size, kvh, d).transpose(1, 2)
        values = v_cache[tables].reshape(n, nb * block_size, kvh, d).transpose(1, 2)
        pos = torch.arange(nb * block_size, device=q.device)
        mask = pos[None, :] < seq_lens[:, None]
        if window:
            mask &= pos[None, :] >= seq_lens[:, None] - window
        mask = mask.view(n, 1, 1, -1)
        o = F.scaled_dot_product_attention(q.unsqueeze(2), keys.to(q.dtype), values.to(q.dtype),
                                           attn_mask=mask, scale=scale, enable_gqa=True)
        return o.squeeze(2)

    @staticmethod
    def _prefill(q, k_cache, v_cache, table, ctx: int, block_size: int, scale: float,
                 window: int | None = None) -> torch.Tensor:
        n = q.shape[0]
        nb = -(-ctx // block_size)
        kvh, d = k_cache.shape[2], k_cache.shape[3]
        keys = k_cache[table[:nb]].reshape(-1, kvh, d)[:ctx].transpose(0, 1).unsqueeze(0)
        values = v_cache[table[:nb]].reshape(-1, kvh, d)[:ctx].transpose(0, 1).unsqueeze(0)
        qh = q.transpose(0, 1).unsqueeze(0)
        if window and window < ctx:
            qpos = torch.arange(ctx - n, ctx, device=q.device)[:, None]
            kpos = torch.arange(ctx, device=q.device)[None, :]
            mask = (kpos <= qpos) & (kpos > qpos - window)
            o = F.scaled_dot_product_attention(qh, keys.to(q.dtype), values.to(q.dtype),
                                               attn_mask=mask, scale=scale, enable_gqa=True)
        elif n == ctx:
            o = F.scaled_dot_product_attention(qh, keys.to(q.dtype), values.to(q.dtype),
                                               is_causal=True, scale=scale, enable_gqa=True)
        else:
            qpos = torch.arange(ctx - n, ctx, device=q.device)
            mask = qpos[:, None] >= torch.arange(ctx, device=q.device)[None, :]
            o = F.scaled_dot_product_attention(qh, keys.to(q.dtype), values.to(q.dtype),
                                               attn_mask=mask, scale=scale, enable_gqa=True)
        return o.squeeze(0).transpose(0, 1)
