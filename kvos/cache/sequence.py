"""The view of a request that the KV memory system needs (no scheduler or torch types)."""
from __future__ import annotations

from typing import Protocol


class CacheableSequence(Protocol):
    """Token ids, progress and tenant of one sequence.

    ``all_token_ids`` holds prompt then output tokens; the first ``num_computed_tokens`` of them
    have KV in the sequence's blocks (or will once the current step runs).

    ``all_token_ids`` only grows while the KV manager knows the sequence (from its first
    ``get_computed_blocks``/``allocate_slots`` to ``free``): the manager memoizes the hashes of
    its full blocks, so a token changed or removed in between would register a block under
    another content's hash.
    """

    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int
    cache_salt: str | None
    priority: int
    """Lower is more important (as the scheduler orders); the weighted eviction policy values a
    block by the most important request that cached or hit it."""

    exact_tokens: int | None
    """KV from this position on is approximate (segment reuse) and is never registered; None:
    all exact. Read with ``getattr(seq, "exact_tokens", None)`` (simulated sequences may lack it)."""

    swapped_tokens: int
    """Tokens whose cache waits in host memory to be copied back (swap preemption), else 0: the
    state group keeps a page where their last state goes back. Read with ``getattr``."""

    media: tuple
    """The prompt's images (``kvos.core.media.MediaItem``): their keys go into the hashes of the
    blocks holding their tokens. Read with ``getattr`` (text-only sequences may lack it)."""

    @property
    def num_tokens(self) -> int: ...
