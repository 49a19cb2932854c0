"""Hash → block index of the prefix cache (the lookup half of automatic prefix caching)."""
from __future__ import annotations

from kvos.cache.block import BlockHash, KVBlock


class PrefixIndex:
    """Maps a chained block hash to the one device block that holds that content.

    At most one block per hash: a second block computed with the same content stays
    unregistered (it is freed as a plain block). Tiers below the device key on the same hashes.
    """

    def __init__(self) -> None:
        self._blocks: dict[BlockHash, KVBlock] = {}

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._blocks

    def hashes(self):
        """A view of every registered hash."""
        return self._blocks.keys()

    def blocks(self):
        """A view of every registered block."""
        return self._blocks.values()

    def get(self, block_hash: BlockHash) -> KVBlock | None:
        return self._blocks.get(block_hash)

    def insert(self, block_hash: BlockHash, block: KVBlock) -> bool:
        """Register ``block`` under ``block_hash``; False (and no change) if the hash is taken."""
        if block_hash in self._blocks:
            return False
        self._blocks[block_hash] = block
        return True

    def remove(self, block_hash: BlockHash) -> KVBlock | None:
        return self._blocks.pop(block_hash, None)

    def clear(self) -> None:
        self._blocks.clear()
