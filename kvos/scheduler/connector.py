"""The KV connector contract: how KV blocks that the device pool does not hold reach it (tiers
below the device, another engine's prefill) and how computed blocks leave it.

Two sides, as in vLLM's KV connector: the scheduler side runs on the engine thread and never
blocks; the worker side runs where the KV tensor lives and moves bytes. Implementations:
``OffloadManager`` + ``TierIO`` (``kvos.connector.offload``, ``kvos.connector.tier_io``) over a
``TierHierarchy`` whose sources are the CPU, disk and Redis tiers and, on a decode engine of
disaggregated prefill, the ``TransferTier`` that another engine's blocks are put into
(``receive``).
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

from kvos.cache.block import BlockHash
from kvos.core.request import Request
from kvos.scheduler.scheduler import PrefixLoad


@runtime_checkable
class KVConnectorScheduler(Protocol):
    """Engine thread only; no call blocks on I/O."""

    def lookup(self, request: Request, hashes: list[BlockHash]) -> int | None:
        """How many leading ``hashes`` (``request``'s blocks after its device hit) another store
        can supply, or None while the answer is not known yet (asked; ask again next step)."""

    def dispatch(self, loads: list[PrefixLoad]) -> None:
        """Start filling the blocks of requests the scheduler admitted in the LOADING state."""

    def install_ready(self, block: bool = False) -> None:
        """Write finished loads into their blocks and hand each request back to the scheduler
        (``Scheduler.finish_loading``, with how many blocks arrived: the rest is computed)."""

    def after_step(self) -> None:
        """Save what the step computed (per the write policy)."""

    def receive(self, hashes: list[BlockHash], rows) -> int:
        """Take blocks another engine computed (``rows``: uint8 ``[n, block_bytes]``) so that
        a request sent next finds them; returns how many were kept."""

    def close(self) -> None: ...


@runtime_checkable
class KVConnectorWorker(Protocol):
    """Moves bytes between the KV tensor and a store; called on the connector's I/O thread
    (``store``, ``fetch``) and the engine thread (``install``)."""

    def store(self, hashes: list[BlockHash], rows, evicted: bool) -> None: ...

    def fetch(self, hashes: list[BlockHash]): ...

    def install(self, loaded, block_ids: list[int]) -> None: ...
