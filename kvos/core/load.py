"""What an engine reports of its load, for routers and fleet views. Pure Python."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """One engine's load when a request is routed.

    ``prefill_tokens``: prompt tokens queued or in flight that are not computed yet (a waiting
    request counts its prompt less the prefix the cache held when it arrived). ``active_blocks``: KV blocks the running sequences span (each sequence counts
    its own, as a router counts them without seeing which are shared)."""

    waiting: int = 0
    running: int = 0
    prefill_tokens: int = 0
    active_blocks: int = 0

    def blocks(self, block_size: int, prefill_weight: float = 1.0) -> float:
        """The load in blocks: ``prefill_weight * prefill_tokens / block_size + active_blocks``."""
        return prefill_weight * self.prefill_tokens / block_size + self.active_blocks
