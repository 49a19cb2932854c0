"""What a ``BlockPool`` tells the components around it, as protocols given at construction.

Two roles:
- the *owner* (``PoolOwner``, the ``KVCacheManager`` or the simulator's tier) decides what a
  pool evicts when it needs a block and has none free (balanced eviction across groups,
  blocks waiting requests will hit kept last);
- *listeners* (``BlockPoolListener``: the KV event log, the tier connector's write-through
  and write-back, a test's checker) hear every registration and every eviction.

Safety rules for listeners: ``block_cached`` runs right after a block entered the prefix index;
``block_evicting`` runs before a block loses its cached content, while its KV bytes are intact
(write-back reads them then). Neither may allocate, free, touch or evict blocks of any pool.
"""
from __future__ import annotations

from typing import Protocol

from kvos.cache.block import KVBlock
from kvos.cache.events import KVEventLog


class BlockPoolListener(Protocol):
    """Hears one pool's (or every group's pool's) registrations and evictions."""

    def block_cached(self, group: int, block: KVBlock, adopted: bool) -> None:
        """``block`` was registered in cache group ``group``'s prefix index (``adopted``: its KV came from
        elsewhere, another engine or a lower tier's copy, not from this engine's step)."""

    def block_evicting(self, group: int, block: KVBlock) -> None:
        """``block`` of cache group ``group`` (unreferenced, still registered) is about to lose
        its cached content."""


class PoolOwner(Protocol):
    """Chooses what a pool evicts when it needs a block and holds no plain free one."""

    def before_evict(self, group: int) -> None:
        """Called before the pool of cache group ``group`` evicts anything (e.g. hold what
        waiting requests will hit)."""

    def reclaim(self, group: int) -> bool:
        """Evict one cached block (of that group's pool or of another sharing its pages); False
        when nothing can be evicted."""


class CachedBlocks:
    """A listener that collects the blocks a step registered, per pool group, in order, for a
    consumer that drains them after the step (write-through to a tier). Adopted blocks are
    not collected (they are another engine's to store)."""

    def __init__(self) -> None:
        self.blocks: list[tuple[int, KVBlock]] = []

    def block_cached(self, group: int, block: KVBlock, adopted: bool) -> None:
        if not adopted:
            self.blocks.append((group, block))

    def block_evicting(self, group: int, block: KVBlock) -> None:
        pass

    def drain(self) -> list[tuple[int, KVBlock]]:
        """(group, block) of every block registered since the last drain still cached now."""
        out = [(g, b) for g, b in self.blocks if b.block_hash is not None]
        self.blocks.clear()
        return out


class EventLogListener:
    """A listener that logs every registration and eviction in a ``KVEventLog`` (each block
    ``block_tokens`` tokens)."""

    def __init__(self, log: KVEventLog, block_tokens: int) -> None:
        self.log = log
        self.block_tokens = block_tokens

    def block_cached(self, group: int, block: KVBlock, adopted: bool) -> None:
        assert block.block_hash is not None and block.parent_hash is not None
        self.log.stored(block.block_hash, block.parent_hash, self.block_tokens, group)

    def block_evicting(self, group: int, block: KVBlock) -> None:
        assert block.block_hash is not None
        self.log.removed(block.block_hash, group)
