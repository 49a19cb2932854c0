"""Tiers below the device pool (CPU memory, local disk, Redis/Valkey), keyed by block hash.

Pure Python: a tier stores opaque bytes (one block's KV across its cache group's layers) under
the block's key (its chained hash, bound to its cache group: ``keys``), in a frame bound to that
key and verified on every load (a keyed checksum; a digest checked on the device after the copy
for the CPU tier on a GPU; or AES-256-GCM with the key as associated data for the disk and Redis
tiers when a key is given). The CPU tier keeps
blocks in the slots of a ``SlotArena`` over memory from a pluggable allocator (pinned by the
engine on a GPU).
"""
from kvos.cache.tiers.arena import SlotArena, allocate_bytearray
from kvos.cache.tiers.base import Tier, TierStats
from kvos.cache.tiers.codec import (
           DigestCodec,
           PlainCodec,
           SealedCodec,
           decode,
           encode,
           load_key_file,
)
from kvos.cache.tiers.cpu import CPUTier, TransferTier
from kvos.cache.tiers.disk import DiskTier
from kvos.cache.tiers.hierarchy import TierHierarchy
from kvos.cache.tiers.keys import group_key, group_tags
from kvos.cache.tiers.remote import RedisTier

__all__ = ["CPUTier", "DigestCodec", "DiskTier", "PlainCodec", "RedisTier", "SealedCodec", "SlotArena", "Tier", "TierHierarchy",
           "TierStats", "TransferTier", "allocate_bytearray", "decode", "encode", "group_key", "group_tags",
           "load_key_file"]
