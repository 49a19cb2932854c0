"""The scheduler's policies, chosen by name from registries: the waiting-queue order
(``scheduling_policy``) and the preemption victim order (``preemption_order``). Adding one is a
class with a ``name`` and the registry's decorator. Pure Python (no torch)."""
from __future__ import annotations

import heapq
from typing import Protocol

from kvos.core.registry import Registry
from kvos.core.request import Request

WaitingEntry = tuple[tuple, Request]


class PolicySettings(Protocol):
    """The scheduler settings a policy reads (``SchedulerConfig`` has them)."""

    fairness_steps: int


class PrefixHits(Protocol):
    """What the lpm order asks the KV manager: a request's cached leading tokens."""

    def longest_hit_tokens(self, req: Request, max_tokens: int) -> int: ...


class WaitingQueuePolicy:
    """Orders the waiting queue: the smallest ``key`` is admitted first. ``reorder`` (called
    before admission when ``reorders`` is set) may re-key the whole queue; it returns a heap of
    ``(key, request)`` entries. Contract: ``key`` is a tuple comparable with every other key the
    policy makes; it depends only on fields fixed while the request waits."""

    name = "base"
    reorders = False

    def __init__(self, config: PolicySettings) -> None:
        self.config = config

    def key(self, req: Request) -> tuple:
        return (0, req.arrival, req.sample_index)

    def reorder(self, waiting: list[WaitingEntry], kv: PrefixHits, step: int) -> list[WaitingEntry]:
        return waiting


class VictimOrder:
    """Chooses the preemption victim when blocks run out: the running sequence with the largest
    ``key`` goes first. ``queue`` is the scheduler's waiting-queue policy."""

    name = "base"

    def __init__(self, config: PolicySettings, queue: WaitingQueuePolicy) -> None:
        self.config = config
        self.queue = queue

    def key(self, req: Request) -> tuple:
        raise NotImplementedError


WAITING_POLICIES: Registry[type[WaitingQueuePolicy]] = Registry("scheduling policy")
"""Waiting-queue policies by name (``scheduling_policy``)."""
VICTIM_ORDERS: Registry[type[VictimOrder]] = Registry("preemption order")
"""Preemption victim orders by name (``preemption_order``)."""
register_waiting_policy = WAITING_POLICIES.register
register_victim_order = VICTIM_ORDERS.register


@register_waiting_policy
class FirstComeFirstServed(WaitingQueuePolicy):
    """Arrival order (a request's samples in index order)."""

    name = "fcfs"


@register_waiting_policy
class PriorityFirst(WaitingQueuePolicy):
    """Lower ``priority`` value first, then arrival order."""

    name = "priority"

    def key(self, req: Request) -> tuple:
        return (req.priority, req.arrival, req.sample_index)


@register_waiting_policy
class LongestPrefixMatch(WaitingQueuePolicy):
    """Longest-prefix-match first (SGLang's cache-aware order) among the oldest ``WINDOW``
    waiting requests; ties and the rest stay first come, first served. A request that has
    waited ``fairness_steps`` steps goes ahead of all (oldest first), so no request waits longer
    than that behind later arrivals while it could be admitted."""

    name = "lpm"
    reorders = True
    WINDOW = 256

    def reorder(self, waiting: list[WaitingEntry], kv: PrefixHits, step: int) -> list[WaitingEntry]:
        if len(waiting) < 2:
            return waiting
        entries = sorted(waiting, key=lambda e: (e[1].arrival, e[1].sample_index))
        head, tail = entries[: self.WINDOW], entries[self.WINDOW:]
        overdue = step - self.config.fairness_steps

        def key(r: Request, hit: int) -> tuple:
            if r.queued_at_step <= overdue:
                return (0, 0, r.arrival, r.sample_index)  # overdue: first come, first served
            return (1, -hit, r.arrival, r.sample_index)

        keyed = [(key(r, 0 if r.needs_all_prompt_positions else kv.longest_hit_tokens(r, r.num_tokens - 1)), r)
                 for _, r in head]
        keyed += [(key(r, 0), r) for _, r in tail]
        heapq.heapify(keyed)
        return keyed


@register_victim_order
class LatestFirst(VictimOrder):
    """Lowest priority (highest value; under the priority queue only), then the latest
    arrival: the waiting queue's order, reversed."""

    name = "latest"

    def key(self, req: Request) -> tuple:
        return self.queue.key(req)


@register_victim_order
class LeastProgressFirst(VictimOrder):
    """Lowest priority, then the least progress lost (fewest computed tokens), then the latest
    arrival."""

    name = "least_progress"

    def key(self, req: Request) -> tuple:
        return (req.priority, -req.num_computed_tokens, req.arrival, req.sample_index)
