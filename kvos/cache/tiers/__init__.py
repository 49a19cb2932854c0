"""Tiers below the device pool (CPU memory, local disk, Redis/Valkey), keyed by block hash.

Pure Python: a tier stores opaque bytes (one block's KV across all layers) under the block's
chained hash, with a checksum verified on every load.
"""
from kvos.cache.tiers.base import Tier, TierStats
from kvos.cache.tiers.codec import decode, encode
from kvos.cache.tiers.cpu import CPUTier
from kvos.cache.tiers.disk import DiskTier
from kvos.cache.tiers.hierarchy import TierHierarchy
from kvos.cache.tiers.remote import RedisTier

__all__ = ["CPUTier", "DiskTier", "RedisTier", "Tier", "TierHierarchy", "TierStats", "decode", "encode"]
