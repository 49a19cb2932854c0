"""An online estimate of how much a cached block is worth keeping, from what happened to blocks
like it: the hit density of its reuse class at its age.

Pure Python. A block's *class* is what the engine knows of it when it is freed (what it holds:
prompt, the last full block of a prompt, or generated tokens; how often prefix hits took it);
its *age* is the time since it was last freed or hit, in the pool's logical clock (one tick per
free, hit and caching), so ages scale with the traffic, not with wall time.

For each class the estimator keeps decayed histograms over log-spaced age buckets of the ages at
which its blocks were hit and at which they were evicted. From them, the *hit density* at age
``a`` (Beckmann et al., "LHD: Improving Cache Hit Rate by Maximizing Hit Density", NSDI'18) is
the expected number of hits a block of that class and age will still get, divided by the
expected time it will still occupy the cache. With ``n[b] = hits[c][b] + evictions[c][b]``, a
bucket's events counted at its upper age and ``a`` taken as its bucket's lower age:

    density(c, a) = (sum_{b >= a} hits[c][b] + 0.01) / (sum_{b >= a} n[b] * (upper(b) - a + 1) + 1)

A class never seen at or beyond an age borrows the density of all classes there (the prior);
the pseudo-counts keep every estimate positive and finite.
"""
from __future__ import annotations

import math

NUM_BUCKETS = 64
"""Age buckets: bucket ``b`` covers ages ``[2**(b/2), 2**((b+1)/2))`` (two per octave)."""

_LOWER = [0.0] + [2.0 ** (b / 2) for b in range(1, NUM_BUCKETS)]
_UPPER = [2.0 ** ((b + 1) / 2) for b in range(NUM_BUCKETS)]


def age_bucket(age: float) -> int:
    """The bucket holding ``age`` (>= 0)."""
    if age < 1.4142135623730951:
        return 0
    return min(NUM_BUCKETS - 1, int(2 * math.log2(age)))


class HitDensityEstimator:
    """Per-class decayed hit and eviction histograms and the hit-density table they give.

    ``record_hit`` and ``record_eviction`` are O(1). The table is rebuilt (O(classes x buckets))
    after 32 records, then after twice as many each time up to every ``refresh`` records, and at
    each rebuild the histograms decay by ``decay``, so the estimate is early and follows a
    workload that changes. ``density`` reads the table: O(1).
    """

    def __init__(self, num_classes: int, refresh: int = 4096, decay: float = 0.9) -> None:
        if num_classes < 1 or refresh < 1 or not 0.0 < decay <= 1.0:
            raise ValueError("HitDensityEstimator: num_classes and refresh must be >= 1, decay in (0, 1]")
        self.num_classes = num_classes
        self.refresh = refresh
        self.decay = decay
        self.hits = [[0.0] * NUM_BUCKETS for _ in range(num_classes)]
        self.evictions = [[0.0] * NUM_BUCKETS for _ in range(num_classes)]
        self._since_refresh = 0
        self._interval = min(32, refresh)
        self.table = [[1.0] * NUM_BUCKETS for _ in range(num_classes)]
        """density by class and age bucket; all equal until the first refresh (LRU order)."""

    def record_hit(self, cls: int, age: float) -> None:
        self.hits[cls][age_bucket(age)] += 1.0
        self._tick()

    def record_eviction(self, cls: int, age: float) -> None:
        self.evictions[cls][age_bucket(age)] += 1.0
        self._tick()

    def density(self, cls: int, age: float) -> float:
        return self.table[cls][age_bucket(age)]

    def _tick(self) -> None:
        self._since_refresh += 1
        if self._since_refresh >= self._interval:
            self._since_refresh = 0
            self._interval = min(2 * self._interval, self.refresh)
            self.rebuild()
            for rows in (self.hits, self.evictions):
                for row in rows:
                    for b in range(NUM_BUCKETS):
                        row[b] *= self.decay

    @staticmethod
    def _densities(hits: list[float], evictions: list[float]) -> list[float | None]:
        """Hit density at each bucket's lower age; None where nothing was seen at or beyond it."""
        out: list[float | None] = [None] * NUM_BUCKETS
        h = events = lifetime = 0.0  # sums over buckets >= b of hits, events, events * age(bucket)
        for b in range(NUM_BUCKETS - 1, -1, -1):
            n = hits[b] + evictions[b]
            h += hits[b]
            events += n
            lifetime += n * _UPPER[b]
            if events > 0:
                remaining = lifetime - events * _LOWER[b]
                out[b] = (h + 0.01) / (remaining + events + 1.0)
        return out

    def rebuild(self) -> None:
        """Recompute the density table from the histograms (a class falls back to the prior, all
        classes together, at ages where it has no observations)."""
        total_h = [sum(row[b] for row in self.hits) for b in range(NUM_BUCKETS)]
        total_e = [sum(row[b] for row in self.evictions) for b in range(NUM_BUCKETS)]
        prior = self._densities(total_h, total_e)
        for c in range(self.num_classes):
            own = self._densities(self.hits[c], self.evictions[c])
            self.table[c] = [o if o is not None else (p if p is not None else 1.0) for o, p in zip(own, prior)]
