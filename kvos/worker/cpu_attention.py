"""The CPU backend: the torch reference, with decodes over float32 caches in a C kernel."""
from __future__ import annotations

from kvos.kernels.cpu.paged_attention import decode_attention, supports
from kvos.worker.torch_attention import TorchReferenceBackend


class CpuBackend(TorchReferenceBackend):
    """Decode rows attend through ``kernels.cpu.paged_attention`` (reading K/V in place through
    the block tables) where it applies; quantized caches, other dtypes and prefills take the
    torch reference's path."""

    def _decode(self, q, cache, meta, scale, window):
        if cache.quantized or not supports(q, cache.k, cache.v):
            return super()._decode(q, cache, meta, scale, window)
        nd = q.shape[0]
        return decode_attention(q, cache.k, cache.v, meta.block_tables[:nd], meta.seq_lens[:nd],
                                scale, window)
