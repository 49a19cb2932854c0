"""N-gram prompt lookup: drafts copied from where the sequence's tail occurred before."""
from __future__ import annotations


class NgramIndex:
    """For one sequence, the latest position after each ``n``-gram of its tokens
    (``min_n <= n <= max_n``), kept up to date as tokens are appended: O(max_n) per token.

    Invariant: an ``n``-gram is indexed only once the token after it is known, so the lookup of
    the sequence's own tail finds an earlier occurrence, never itself.
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.after: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_n + 1)]
        self.seen = 0  # tokens whose preceding n-grams are indexed

    def extend(self, tokens: list[int]) -> None:
        """Index every n-gram of ``tokens`` (the whole sequence so far) followed by a known token."""
        for end in range(max(self.seen, 1), len(tokens)):  # the n-grams ending just before ``end``
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self.after[n][tuple(tokens[end - n: end])] = end
        self.seen = max(self.seen, len(tokens))

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens following the latest earlier occurrence of the longest tail of
        ``tokens`` (``max_n`` down to ``min_n`` tokens) seen before; [] when none."""
        self.extend(tokens)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            pos = self.after[n].get(tuple(tokens[-n:]))
            if pos is not None:
                return tokens[pos: pos + k]
        return []


class NgramProposer:
    """Drafts for many sequences by prompt lookup, one ``NgramIndex`` each."""

    def __init__(self, num_tokens: int, min_n: int, max_n: int) -> None:
        self.k, self.min_n, self.max_n = num_tokens, min_n, max_n
        self._index: dict[str, NgramIndex] = {}

    def propose(self, request_id: str, tokens: list[int], k: int | None = None) -> list[int]:
        index = self._index.get(request_id)
        if index is None:
            index = self._index[request_id] = NgramIndex(self.min_n, self.max_n)
        return index.propose(tokens, self.k if k is None else k)

    def drop(self, request_id: str) -> None:
        """Forget a finished sequence."""
        self._index.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._index)
