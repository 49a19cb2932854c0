"""Tiers below the device pool (CPU memory, local disk, Redis/Valkey), keyed by block hash.

Pure Python: a tier stores opaque bytes (one block's KV across all layers) under the block's
chained hash, with a checksum verified on every load. The CPU tier keeps blocks in the slots of
a ``SlotArena`` over memory from a pluggable allocator (pinned by the engine on a GPU).
"""
from kvos.cache.tiers.arena import SlotArena, allocate_bytearray
from kvos.cache.tiers.base import Tier, TierStats
from kvos.cache.tiers.codec import decode, encode
from kvos.cache.tiers.cpu import CPUTier
from kvos.cache.tiers.disk import DiskTier
from kvos.cache.tiers.hierarchy import TierHierarchy
from kvos.cache.tiers.remote import RedisTier

__all__ = ["CPUTier", "DiskTier", "RedisTier", "SlotArena", "Tier", "TierHierarchy", "TierStats",
           "allocate_bytearray", "decode", "encode"]
