"""The CPU backend: the torch reference, with decodes over float32 caches in a C kernel."""
from __future__ import annotations

from kvos.kernels.cpu.paged_attention import decode_attention, supports, write_kv
from kvos.worker.torch_attention import TorchReferenceBackend


class CpuBackend(TorchReferenceBackend):
    """On float32 caches, new K/V are written and decode rows attend through
    ``kernels.cpu.paged_attention`` (reading K/V in place through the block tables); quantized
    caches, other dtypes and prefill attention take the torch reference's path."""

    cpu_decode_kernel = True
    """Decode rows over float32 caches are exactly ``paged_decode_attention`` (models may call
    it from C: ``kvos.kernels.cpu.decoder_layers``)."""

    def _write(self, k, v, cache, slot_mapping):
        if cache.quantized or not supports(k, cache.k, cache.v):
            return super()._write(k, v, cache, slot_mapping)
        write_kv(k, v, cache.k, cache.v, slot_mapping)

    def _decode(self, q, cache, meta, scale, window):
        if cache.quantized or not supports(q, cache.k, cache.v):
            return super()._decode(q, cache, meta, scale, window)
        nd = q.shape[0]
        return decode_attention(q, cache.k, cache.v, meta.block_tables[:nd], meta.seq_lens[:nd],
                                scale, window)
