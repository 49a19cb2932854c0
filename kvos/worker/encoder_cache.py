"""Encoder outputs (an image's soft tokens) kept on the device by content key, so that a later
request with the same image skips the encoder even when its KV is gone."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch

from kvos.core.media import MediaItem


class EncoderCache:
    """Least recently used encodings within ``capacity_bytes`` (0: none kept; every image is
    encoded each time a step needs it). Keys are ``MediaItem.key`` (content hash salted per
    tenant). Safety rule: ``lookup`` hands out the cached tensor itself; callers only read it,
    within the step (an eviction drops the cache's reference, never the data under a reader)."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.bytes = 0
        self.runs = 0
        """Images encoded (one per miss)."""
        self.hits = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def encodings(self, items: Sequence[MediaItem],
                  encode: Callable[[list[MediaItem]], torch.Tensor]) -> dict[str, torch.Tensor]:
        """Each item's encoding by key: cached ones from here, the rest from one ``encode`` call
        over the missing items (``[len(missing), tokens, hidden]``), then kept."""
        found: dict[str, torch.Tensor] = {}
        missing: dict[str, MediaItem] = {}
        for m in items:
            if m.key in found or m.key in missing:
                continue
            t = self._entries.get(m.key)
            if t is None:
                if m.data is None:
                    raise RuntimeError(f"image {m.key[:12]}: not cached and sent without its pixels")
                missing[m.key] = m
            else:
                self._entries.move_to_end(m.key)
                self.hits += 1
                found[m.key] = t
        if missing:
            out = encode(list(missing.values()))
            self.runs += len(missing)
            for i, key in enumerate(missing):
                found[key] = out[i]
                self._put(key, out[i])
        return found

    def _put(self, key: str, t: torch.Tensor) -> None:
        size = t.numel() * t.element_size()
        if size > self.capacity_bytes:
            return
        self._entries[key] = t.clone()  # its own storage: the batch's tensor is not held whole
        self.bytes += size
        while self.bytes > self.capacity_bytes:
            _, old = self._entries.popitem(last=False)
            self.bytes -= old.numel() * old.element_size()
            self.evictions += 1

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0

    def stats(self) -> dict:
        return {"encoder_runs": self.runs, "encoder_cache_hits": self.hits, "encoder_cache_bytes": self.bytes,
                "encoder_cache_entries": len(self._entries), "encoder_cache_evictions": self.evictions,
                "encoder_cache_capacity_bytes": self.capacity_bytes}
