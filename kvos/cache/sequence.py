"""The view of a request that the KV memory system needs (no scheduler or torch types)."""
from __future__ import annotations

from typing import Protocol


class CacheableSequence(Protocol):
    """Token ids, progress and tenant of one sequence.

    ``all_token_ids`` holds prompt then output tokens; the first ``num_computed_tokens`` of them
    have KV in the sequence's blocks (or will once the current step runs).
    """

    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int
    cache_salt: str | None
    priority: int
    """Lower is more important (as the scheduler orders); the weighted eviction policy values a
    block by the most important request that cached or hit it."""

    @property
    def num_tokens(self) -> int: ...
