"""KV blocks handed from a prefill engine to a decode engine (disaggregated prefill).

Two forms of the same rows (uint8 ``[n, block_bytes]``, as ``ModelRunner.read_blocks`` lays
them out):
- host rows (a numpy array): any transport, any device; the decode engine puts them into its
  transfer tier and loads them as tier hits;
- ``DeviceRows``: the rows stay on the prefill engine's GPU and only a CUDA IPC handle travels
  (through the front end, which never touches CUDA); the decode engine, a process on the same
  host that sees that GPU, copies them GPU to GPU (NVLink or PCIe peer access) straight into
  free blocks of its pool and caches them under their hashes (``LLMEngine.adopt_blocks``).
  With tensor parallelism on both sides (the same size), ``RankRows``: rank r's part of each
  block stays on the prefill engine's rank-r GPU, and the decode engine's rank r copies it;
- ``PeerRows``: the rows stay on the prefill engine's device (a gathered copy per rank), and the
  decode engine's rank r pulls part r over a point-to-point channel (NCCL send/recv between
  GPUs, on one host or between hosts; gloo on the CPU; ``kvos.worker.peer_channel``). Only the
  tickets travel through the front end.

Which form a hand-over takes is the front end's ``kv_transfer`` (``TRANSFERS``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvos.worker.device_rows import DeviceRows, RankRows
from kvos.worker.peer_channel import PeerRows

__all__ = ["DEVICE_ROWS", "TRANSFERS", "DeviceRows", "ExtractedBlocks", "PeerRows", "RankRows"]

TRANSFERS = ("host", "ipc", "p2p")
"""How a prefill engine hands a prompt's blocks over: ``host`` rows (any transport), CUDA ``ipc``
handles (processes of one GPU host), or ``p2p`` tickets (pulled over NCCL/gloo send/recv)."""
DEVICE_ROWS = (DeviceRows, RankRows, PeerRows)
"""Rows that stay on the prefill engine's device until the decode engine has them: the front end
reports each hand-over done to the prefill engine (``transfer_done``)."""


@dataclass
class ExtractedBlocks:
    """A prompt's leading full blocks as a prefill engine's cache holds them."""

    hashes: list[bytes]
    parent: bytes | None
    """The hash chain's parent of ``hashes[0]`` (the prompt's root for its first block)."""
    depth: int
    """``hashes[0]``'s place in its chain (0: the prompt's first block)."""
    rows: Any
    """Host rows (numpy ``uint8 [n, block_bytes]``), ``DeviceRows`` (``RankRows`` from a
    tensor-parallel engine: one ``DeviceRows`` per rank), ``PeerRows``, or None when empty."""

    @property
    def nbytes(self) -> int:
        if self.rows is None:
            return 0
        return self.rows.nbytes
