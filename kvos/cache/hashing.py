"""Chained content hashes of full blocks.

A block's hash covers its parent's hash, its token ids and extra keys (the keys of the images
whose tokens it holds); the chain's root covers
the model and the tenant's cache salt. Two blocks share a hash only if their whole prefixes,
model and salt are equal, so matching a hash means the KV content is equal (invariants 3 and 4).
Hashes are stable across processes and machines (blake2b), so tiers and routers can key on them.
"""
from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from kvos.cache.block import BlockHash
from kvos.core.media import MediaItem, block_media_keys

_DIGEST = 16


def root_hash(model_id: str, cache_salt: str | None = None) -> BlockHash:
    """The parent hash of a request's first block: the model identity and the tenant salt."""
    h = hashlib.blake2b(digest_size=_DIGEST, person=b"kvos-root")
    h.update(model_id.encode("utf-8", "surrogatepass"))
    h.update(b"\x00")
    h.update((cache_salt or "").encode("utf-8", "surrogatepass"))  # any str, even lone surrogates
    return h.digest()


def hash_block(parent: BlockHash, token_ids: Sequence[int], extra_keys: tuple = ()) -> BlockHash:
    """Hash one full block given its parent's hash, its tokens and per-block extra keys."""
    h = hashlib.blake2b(parent, digest_size=_DIGEST)
    h.update(array("q", token_ids).tobytes())
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return h.digest()


def extend_block_hashes(
    hashes: list[BlockHash], token_ids: Sequence[int], block_size: int, root: BlockHash,
    media: Sequence[MediaItem] = (),
) -> None:
    """Append to ``hashes`` the hash of every full block of ``token_ids`` not yet hashed. A block
    holding positions of ``media`` items hashes their keys too (the same placeholder tokens stand
    for any image)."""
    while (len(hashes) + 1) * block_size <= len(token_ids):
        i = len(hashes)
        parent = hashes[-1] if hashes else root
        extra = block_media_keys(media, i, block_size) if media else ()
        hashes.append(hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], extra))
