"""Tier keys of cache groups' blocks.

The prefix cache keys every group's block of one position by the same chained hash (the
groups' indexes are separate). A tier is one flat store for all groups, so a block's tier key
binds its group too: ``group_key(block_hash, tag)`` with the group's ``tag`` (its kind, window,
layers and page layout, ``group_tags``). Two groups' blocks of one hash therefore never share a
key, nor do blocks of layouts that group the layers differently (``unified`` and
``equal_pages``). The chained hash already binds the model, the KV dtype (both in the root's
model id) and the tenant's cache salt, so the key still does.

A layout of one group keys its blocks by the chained hash itself (as before groups existed,
so existing disk and Redis tiers stay valid).
"""
from __future__ import annotations

import hashlib

from kvos.cache.block import BlockHash
from kvos.cache.layout import CacheLayout

_DIGEST = 16


def group_tags(layout: CacheLayout) -> list[bytes | None]:
    """Per group, the bytes its tier keys bind (None for a layout of one group: the hash itself)."""
    if len(layout.groups) == 1:
        return [None]
    return [repr((layout.mode, g.spec.kind, getattr(g.spec, "window", None), g.layers, g.spec.num_layers,
                  g.spec.page_bytes)).encode() for g in layout.groups]


def group_key(block_hash: BlockHash, tag: bytes | None) -> BlockHash:
    """The tier key of a group's block of ``block_hash`` (``tag`` from ``group_tags``)."""
    if tag is None:
        return block_hash
    h = hashlib.blake2b(block_hash, digest_size=_DIGEST, person=b"kvos-tier-group")
    h.update(tag)
    return h.digest()
