"""KV blocks handed from a prefill engine to a decode engine (disaggregated prefill).

Two forms of the same rows (uint8 ``[n, block_bytes]``, as ``ModelRunner.read_blocks`` lays
them out):
- host rows (a numpy array): any transport, any device; the decode engine puts them into its
  transfer tier and loads them as tier hits;
- ``DeviceRows``: the rows stay on the prefill engine's GPU and only a CUDA IPC handle travels
  (through the front end, which never touches CUDA); the decode engine, a process on the same
  host that sees that GPU, copies them GPU to GPU (NVLink or PCIe peer access) straight into
  free blocks of its pool and caches them under their hashes (``LLMEngine.adopt_blocks``).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class DeviceRows:
    """Rows on a GPU of the process that made them, shared by CUDA IPC (torch's handle).

    Safety: the sender's torch keeps the memory alive until the receiver's opened tensor is
    freed (a reference counter in shared memory), so the sender may drop its own reference at
    once. Open it at most once, in one process of the same host that sees the sender's GPU.
    A handle that is never opened keeps its memory until the sender exits."""

    rebuild: Callable[..., Any]
    args: tuple
    nbytes: int

    @classmethod
    def share(cls, rows) -> DeviceRows:
        from torch.multiprocessing.reductions import reduce_tensor

        rebuild, args = reduce_tensor(rows)
        return cls(rebuild, args, rows.numel() * rows.element_size())

    def open(self):
        """The rows as a tensor of this process (the sender's memory, mapped; reads wait for
        the sender's gather through an IPC event)."""
        return self.rebuild(*self.args)


@dataclass
class ExtractedBlocks:
    """A prompt's leading full blocks as a prefill engine's cache holds them."""

    hashes: list[bytes]
    parent: bytes | None
    """The hash chain's parent of ``hashes[0]`` (the prompt's root for its first block)."""
    depth: int
    """``hashes[0]``'s place in its chain (0: the prompt's first block)."""
    rows: Any
    """Host rows (numpy ``uint8 [n, block_bytes]``), ``DeviceRows``, or None when empty."""

    @property
    def nbytes(self) -> int:
        if self.rows is None:
            return 0
        return self.rows.nbytes
