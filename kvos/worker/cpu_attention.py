"""The CPU backend: the torch reference, with writes and decodes in C kernels."""
from __future__ import annotations

import torch

from kvos.kernels.cpu.paged_attention import decode_attention, supports, write_kv
from kvos.kernels.cpu.paged_kv8 import decode_attention_kv8, view_of, write_kv8
from kvos.worker.torch_attention import TorchReferenceBackend


class CpuBackend(TorchReferenceBackend):
    """New K/V are written and decode rows attend through C kernels, reading K/V in place
    through the block tables: ``kernels.cpu.paged_attention`` on float32 caches,
    ``kernels.cpu.paged_kv8`` on int8 / fp8 ones (quantized as ``kv_quant.quantize`` does). Other
    dtypes and prefill attention take the torch reference's path."""

    cpu_decode_kernel = True
    """Decode rows are exactly ``paged_decode_attention`` (float32 caches) or
    ``paged_decode_attention_kv8`` (8-bit ones), so models may call them from C
    (``kvos.kernels.cpu.decoder_layers``)."""

    _kv8: tuple = (None, None)
    """The last 8-bit cache seen and its C view (``paged_kv8.view_of``): a layer's write and its
    decode ask for the same one."""

    def _view(self, cache):
        if self._kv8[0] is not cache:
            self._kv8 = (cache, view_of(*cache))
        return self._kv8[1]

    def _write(self, k, v, cache, slot_mapping):
        if cache.quantized:
            view = self._view(cache) if k.dtype == torch.float32 else None
            if view is None:
                return super()._write(k, v, cache, slot_mapping)
            return write_kv8(k, v, view, slot_mapping, cache.k.shape[1])
        if not supports(k, cache.k, cache.v):
            return super()._write(k, v, cache, slot_mapping)
        write_kv(k, v, cache.k, cache.v, slot_mapping)

    def _decode(self, q, cache, meta, scale, window):
        nd = q.shape[0]
        if cache.quantized:
            view = self._view(cache) if q.dtype == torch.float32 and q.shape[-1] % 8 == 0 else None
            if view is None:
                return super()._decode(q, cache, meta, scale, window)
            return decode_attention_kv8(q, view, cache.k.shape[2], cache.k.shape[1], meta.block_tables[:nd],
                                        meta.seq_lens[:nd], scale, window)
        if not supports(q, cache.k, cache.v):
            return super()._decode(q, cache, meta, scale, window)
        return decode_attention(q, cache.k, cache.v, meta.block_tables[:nd], meta.seq_lens[:nd],
                                scale, window)
