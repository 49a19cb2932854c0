"""Paged attention on a CUDA GPU through the Triton kernels of ``kvos.kernels``."""
from __future__ import annotations

import torch

from kvos.kernels.cache_write import write_kv
from kvos.kernels.decode_attention import paged_decode_attention
from kvos.kernels.prefill_attention import paged_prefill_attention
from kvos.models.attention import AttentionBackend, AttentionMetadata, KVCache
from kvos.worker.torch_attention import TorchReferenceBackend


class TritonBackend(AttentionBackend):
    """K/V are written into their slots first; decodes then run the split-context decode
    kernel and prefill chunks the varlen causal kernel, both reading only the paged cache.

    Sliding-window layers read only the blocks inside their window. Quantized caches are
    quantized by the write kernel and dequantized inside the attention kernels (long prefill
    chunks: into a scratch copy of their contexts first, ``paged_prefill_attention``'s
    ``max_seq_len``). Decode-only steps do no host synchronisation and depend on tensor shapes
    alone, so they can be captured in a CUDA graph (``num_splits`` is fixed per batch shape).
    """

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache,
                meta: AttentionMetadata, scale: float, window: int | None = None) -> torch.Tensor:
        self.write(k, v, cache, meta.slot_mapping)
        return self.attend(q, cache, meta, scale, window, torch.empty_like(q))

    @staticmethod
    def write(k: torch.Tensor, v: torch.Tensor, cache: KVCache, slot_mapping: torch.Tensor) -> None:
        """K/V ``[T, KVH, D]`` into their slots (quantized where the cache has scales); rows
        whose slot is -1 write nothing. Depends on shapes alone: safe inside a CUDA graph."""
        k_cache, v_cache, k_scale, v_scale = cache
        write_kv(k, v, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)

    @staticmethod
    def attend(q: torch.Tensor, cache: KVCache, meta: AttentionMetadata, scale: float, window: int | None,
               out: torch.Tensor) -> torch.Tensor:
        """Attention of ``q`` (``meta``'s rows: decodes first, then prefill chunks) over the paged
        cache alone, into ``out`` ``[T, H, D]``; the step's own K/V must be written first."""
        k_cache, v_cache, k_scale, v_scale = cache
        nd = meta.num_decodes
        if nd:
            paged_decode_attention(q[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd],
                                   scale, out=out[:nd], window=window, k_scale=k_scale, v_scale=v_scale)
        if nd < q.shape[0]:
            paged_prefill_attention(q[nd:], k_cache, v_cache, meta.block_tables[nd:], meta.prefill_start_loc,
                                    meta.seq_lens[nd:], meta.max_prefill_len, scale, out=out[nd:], window=window,
                                    k_scale=k_scale, v_scale=v_scale,
                                    max_seq_len=max(meta.seq_lens_list[nd:], default=None))
            if meta.bidirectional:  # image spans (Gemma 3): those chunks again, with the torch reference's mask
                starts = meta.prefill_start_loc.tolist()
                for j, spans in enumerate(meta.bidirectional):
                    if spans:
                        i, a, b = nd + j, nd + starts[j], nd + starts[j + 1]
                        out[a:b] = TorchReferenceBackend._prefill(
                            q[a:b], cache, meta.block_tables[i], meta.seq_lens_list[i], meta.block_size, scale,
                            window, spans)
        return out
