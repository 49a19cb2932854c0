"""Paged attention in plain torch: the CPU path and the numerical oracle for the Triton kernels."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvos.kernels.kv_quant import dequantize, kv_dtype_of, quantize
from kvos.models.attention import AttentionBackend, AttentionMetadata, KVCache


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
        self._write(k, v, cache, meta.slot_mapping)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            out[:nd] = self._decode(q[:nd], cache, meta, scale, window)
        t = nd
        for i in range(nd, len(meta.query_lens_list)):
            n, ctx = meta.query_lens_list[i], meta.seq_lens_list[i]
            spans = meta.bidirectional[i - nd] if meta.bidirectional else None
            out[t : t + n] = self._prefill(q[t : t + n], cache, meta.block_tables[i], ctx,
                                           meta.block_size, scale, window, spans)
            t += n
        return out

    def _write(self, k, v, cache: KVCache, slot_mapping: torch.Tensor) -> None:
        write_kv(k, v, cache, slot_mapping)

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
                 window: int | None = None, spans: list[tuple[int, int]] | None = None) -> torch.Tensor:
        n = q.shape[0]
        nb = -(-ctx // block_size)
        kvh, d = cache.k.shape[2], cache.k.shape[3]
        keys = gather_kv(cache.k, cache.k_scale, table[:nb], q.dtype).reshape(-1, kvh, d)[:ctx].transpose(0, 1).unsqueeze(0)
        values = gather_kv(cache.v, cache.v_scale, table[:nb], q.dtype).reshape(-1, kvh, d)[:ctx].transpose(0, 1).unsqueeze(0)
        qh = q.transpose(0, 1).unsqueeze(0)
        if spans:
            return _prefill_with_spans(qh, keys, values, ctx, n, scale, window, spans)
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


def span_mask(ctx: int, n: int, window: int | None, spans: list[tuple[int, int]],
              device: torch.device | str = "cpu") -> torch.Tensor:
    """``[n, ctx]`` booleans: may the query at position ``ctx - n + i`` read the key at ``j``?
    Causal (within ``window``), or both in one of ``spans`` (``[s, e)``; the window still bounds
    how far back a key may be, as transformers' sliding mask over its bidirectional one)."""
    qpos = torch.arange(ctx - n, ctx, device=device)[:, None]
    kpos = torch.arange(ctx, device=device)[None, :]
    mask = kpos <= qpos
    for s, e in spans:
        mask |= (qpos >= s) & (qpos < e) & (kpos >= s) & (kpos < e)
    if window:
        mask &= kpos > qpos - window
    return mask


def _prefill_with_spans(qh, keys, values, ctx: int, n: int, scale: float, window: int | None,
                        spans: list[tuple[int, int]]) -> torch.Tensor:
    mask = span_mask(ctx, n, window, spans, qh.device)
    o = F.scaled_dot_product_attention(qh, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
    return o.squeeze(0).transpose(0, 1)
