"""KV events: what an engine's prefix cache gained and lost, in order, for subscribers elsewhere
(a KV-aware router's per-engine index). Pure Python, plain picklable values.

Contract: applying every batch of one engine in sequence order to an empty ``CachedBlockSet``
gives exactly the hashes of that engine's prefix index (per cache group). Batches are numbered
1, 2, 3, ... per engine; a subscriber that sees a gap (or a new ``epoch``: the engine restarted)
knows its view is stale and rebuilds it from ``KVEventLog.snapshot``, which carries the number
of the last batch it includes.
"""
from __future__ import annotations

import uuid

from kvos.cache.block import BlockHash
from kvos.core.kv_events import (
    AllCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    KVSnapshot,
)


class KVEventLog:
    """Collects one engine's events as its block pools change; ``drain`` hands them out as the
    next numbered batch. Only the pools (``BlockPool.cache_full_block`` and ``evict``) and the
    cache manager's reset append to it, on the engine thread."""

    MAX_PENDING = 1 << 18
    """Undrained events kept at most: past it they are dropped and their batch number is burnt,
    so that subscribers see a gap and resync (memory stays bounded with no one draining)."""

    def __init__(self, engine_id: str = "engine-0") -> None:
        self.engine_id = engine_id
        self.epoch = uuid.uuid4().hex  # a restarted engine's numbering starts over in a new epoch
        self.seq = 0
        self._pending: list[KVEvent] = []

    def _append(self, event: KVEvent) -> None:
        if len(self._pending) >= self.MAX_PENDING:
            self._pending.clear()
            self.seq += 1  # a batch no one will receive
        self._pending.append(event)

    def stored(self, block_hash: BlockHash, parent_hash: BlockHash, num_tokens: int, group: int) -> None:
        self._append(BlockStored(block_hash, parent_hash, num_tokens, group))

    def removed(self, block_hash: BlockHash, group: int) -> None:
        self._append(BlockRemoved(block_hash, group))

    def cleared(self) -> None:
        """Everything is gone: earlier events of this batch no longer matter."""
        self._pending = [AllCleared()]

    def drain(self) -> KVEventBatch | None:
        """The events since the last drain as the next batch (None if there are none)."""
        if not self._pending:
            return None
        self.seq += 1
        batch = KVEventBatch(self.engine_id, self.epoch, self.seq, tuple(self._pending))
        self._pending = []
        return batch

    def snapshot(self, groups: list[set[BlockHash] | frozenset[BlockHash]]) -> KVSnapshot:
        """A snapshot of ``groups`` (each group's cached hashes now); call right after ``drain``
        so that it matches the batches numbered up to ``seq``."""
        if self._pending:
            raise RuntimeError("snapshot with undrained events: drain first")
        return KVSnapshot(self.engine_id, self.epoch, self.seq, tuple(frozenset(g) for g in groups))
