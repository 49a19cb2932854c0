"""Counters of the KV memory system, read by the engine, the CLI's ``--stats`` and metrics."""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class CacheCounters:
    """Monotonic counters (tokens where named so, else events)."""

    prefix_queries_tokens: int = 0
    prefix_hits_tokens: int = 0
    evictions: int = 0
    preemptions: int = 0
    recomputed_tokens: int = 0
    cow_copies: int = 0
    tier_hits_tokens: int = 0
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0
    segment_hits: int = 0
    """Segments whose KV was reused at another position (segment reuse)."""
    segment_reused_tokens: int = 0
    segment_recomputed_tokens: int = 0
    """Tokens of hit segments computed anyway (each segment's first ``segment_recompute`` share)."""
    segment_fills: int = 0
    """Segments computed alone to be cached, the first time they were seen."""

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits_tokens / self.prefix_queries_tokens if self.prefix_queries_tokens else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "prefix_hit_rate": self.prefix_hit_rate}


@dataclass(frozen=True)
class CacheUsage:
    """A snapshot of the pool: ``total == free + cached + used`` (the null block excluded).

    ``free`` holds no cached content; ``cached`` holds prefix-cache content and no reference
    (evictable); ``used`` is referenced by at least one request.
    """

    total: int
    free: int
    cached: int
    used: int

    @property
    def usage(self) -> float:
        return self.used / self.total if self.total else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "kv_usage": self.usage}
