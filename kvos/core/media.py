"""Images (and other encoder inputs) in a prompt, as the scheduler, the KV memory system and the
runner see them. Pure Python: the pixels travel as an opaque object."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class MediaItem:
    """One image of a prompt: its soft tokens are prompt positions ``[offset, offset + length)``.

    ``key`` names its content: a hash of the decoded pixels salted with the request's tenant
    (``cache_salt``). The encoder cache is keyed by it, and every KV block holding any of its
    positions hashes it, so two different images never share KV and one tenant never finds
    another's encoding. ``data``: the encoder's input (the processed pixel array), never hashed
    or compared; needed only while the image's positions are still to be computed, unless
    ``encoded`` holds the encoder's output computed elsewhere (an encoder engine), which the
    runner stores as if it had run the encoder. An item with neither can only be served from
    the encoder cache."""

    offset: int
    length: int
    key: str
    data: object = field(default=None, compare=False, repr=False)
    encoded: object = field(default=None, compare=False, repr=False)

    @property
    def end(self) -> int:
        return self.offset + self.length


def media_overlapping(media: Sequence[MediaItem], start: int, end: int) -> list[MediaItem]:
    """The items with a position in ``[start, end)``."""
    return [m for m in media if m.offset < end and m.end > start]


def block_media_keys(media: Sequence[MediaItem], block: int, block_size: int) -> tuple[str, ...]:
    """The keys of the items with a position in block ``block``: its hash's extra keys."""
    lo = block * block_size
    return tuple(m.key for m in media if m.offset < lo + block_size and m.end > lo)


def media_chunk_end(media: Sequence[MediaItem], start: int, end: int) -> int:
    """Where a chunk from ``start`` to at most ``end`` may stop so that no item is split over two
    steps (an image's tokens attend to each other both ways, and its encoding is needed whole):
    an item cut by ``end`` is left for the next step when it begins after ``start``; a chunk that
    begins inside or at an item runs to its end, even past ``end`` (by less than one item)."""
    for m in media:
        if m.offset < end < m.end:
            return m.offset if m.offset > start else m.end
    return end
