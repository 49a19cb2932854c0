"""Paged attention as the models call it: the backend interface, its per-step metadata and the
paged K/V a layer reads. Implementations live with the worker (``kvos.worker.torch_attention``,
``kvos.worker.triton_attention``)."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import NamedTuple

import torch


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
    ``bidirectional`` (or None): per prefill chunk, in order, position spans ``[s, e)`` (an
    image's tokens, Gemma 3) whose queries also attend to the later keys of their own span; a
    chunk holds every position of a span it computes any of past the span's cached part.
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
    bidirectional: list[list[tuple[int, int]]] | None = None


class KVCache(NamedTuple):
    """One layer's paged K and V: ``k``, ``v`` ``[num_blocks, block_size, kv_heads, head_dim]``
    (any strides: views into a page-major pool; the engine's 8-bit V is token-minor,
    ``stride(1) == 1``, which the kernels read a block at a time). A quantized cache (fp8 / int8 storage) has
    float32 scales ``k_scale``, ``v_scale`` ``[num_blocks, block_size, kv_heads]`` beside them
    (``kvos.kernels.kv_quant``); the model's own dtype has none."""

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

    cpu_decode_kernel: bool = False
    """True when decode rows over float32 CPU caches are written by ``paged_write`` and attend
    by ``paged_decode_attention`` (``kvos.kernels.cpu``), so a model may run them from C."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache,
                meta: AttentionMetadata, scale: float, window: int | None = None) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D]; cache: the layer's paged K/V (quantized on write
        when it has scales; attention then reads the dequantized values, its own new tokens'
        included). A query at position p attends keys at positions ``p - window < j <= p`` (all
        ``j <= p`` without a window), and every ``j > p`` of a ``meta.bidirectional`` span
        holding p. Returns [T, H, D]."""
