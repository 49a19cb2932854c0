"""Exponential backoff of drafting, per sequence or per engine."""
from __future__ import annotations


class DraftBackoff:
    """After a miss (a verify that accepted no draft, or a probe that found none), skip the next
    1, 2, 4, ... chances (at most ``max_wait``) for that key; any hit resets it. Drafts that are
    always rejected then cost a verify step every ``max_wait`` chances, not every step."""

    def __init__(self, max_wait: int = 32) -> None:
        self.max_wait = max_wait
        self._wait: dict[str, int] = {}
        self._backoff: dict[str, int] = {}

    def allow(self, key: str) -> bool:
        """Whether ``key`` may draft at this chance (a skipped chance counts down its wait)."""
        wait = self._wait.get(key, 0)
        if wait:
            self._wait[key] = wait - 1
            return False
        return True

    def record(self, key: str, hit: bool) -> None:
        if hit:
            self._backoff.pop(key, None)
            self._wait.pop(key, None)
            return
        b = self._backoff[key] = min(self.max_wait, 2 * self._backoff.get(key, 0) or 1)
        self._wait[key] = b

    def drop(self, key: str) -> None:
        self._wait.pop(key, None)
        self._backoff.pop(key, None)
