"""Continuous batching with chunked prefill and recompute preemption. Pure Python (no torch)."""
from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from kvos.cache.block import KVBlock
from kvos.cache.kv_manager import KVCacheManager
from kvos.core.load import EngineLoad
from kvos.core.media import media_chunk_end
from kvos.core.request import Request, RequestStatus
from kvos.core.step import SegmentCopy
from kvos.scheduler.policies import VICTIM_ORDERS, WAITING_POLICIES
from kvos.scheduler.segments import SEGMENT_HEADERS, SegmentReuse

NO_RANGES: list[tuple[int, int]] = []
"""``Scheduler._chunk``'s ranges for a request without reuse spans (shared: never modified)."""


@dataclass
class SchedulerConfig:
    """The scheduler's settings: ``EngineConfig``'s fields of the same names
    (``EngineConfig.scheduler_config()`` builds it; defaults and help are there). The checks of
    these fields live here, once; ``EngineConfig`` runs them by building this."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    scheduling_policy: str = "fcfs"
    """A name in ``WAITING_POLICIES``: the waiting queue's order."""
    preemption_order: str = "latest"
    """A name in ``VICTIM_ORDERS``: which running sequence is preempted when blocks run out."""
    fairness_steps: int = 64
    """lpm: a request waiting this many steps goes ahead of every later arrival."""
    eviction_lookahead: int = 256
    """Cached prefixes that the next this-many waiting requests will hit are evicted only when
    nothing else is left, the one wanted farthest back in the queue first. It changes which
    cached block goes, never admission. 0: off."""
    segment_reuse: bool = False
    """Requests' ``segments`` take their KV from the same tokens cached alone, at any position
    (``kvos.scheduler.segments``); segments seen for the first time are computed alone too."""
    segment_recompute: float = 0.15
    """Segment reuse: the share of each reused segment's tokens (its first ones) recomputed."""
    segment_header: str = "model"
    """Segment reuse: what a segment is cached after (``kvos.scheduler.segments.SEGMENT_HEADERS``)."""

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "fairness_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if (isinstance(self.segment_recompute, bool) or not isinstance(self.segment_recompute, (int, float))
                or not 0 <= self.segment_recompute <= 1):
            raise ValueError(f"segment_recompute must be a number in [0, 1], got {self.segment_recompute!r}")
        if self.segment_header not in SEGMENT_HEADERS:
            raise ValueError(f"segment_header must be one of {SEGMENT_HEADERS}, got {self.segment_header!r}")
        if not isinstance(self.eviction_lookahead, int) or self.eviction_lookahead < 0:
            raise ValueError(f"eviction_lookahead must be a non-negative integer, got {self.eviction_lookahead!r}")
        for name, registry in (("scheduling_policy", WAITING_POLICIES), ("preemption_order", VICTIM_ORDERS)):
            if getattr(self, name) not in registry:
                raise ValueError(f"{name} must be one of {tuple(registry)}, got {getattr(self, name)!r}")


@dataclass
class ScheduledSeq:
    """``request`` computes tokens ``[start, start + num_new_tokens)`` this step.

    ``samplers`` receive one sampled token each from the logits of the last of those tokens
    (empty while a prefill is still partial; the request and its new forks when ``n > 1``).
    """

    request: Request
    start: int
    num_new_tokens: int
    tables: list[list[KVBlock]]  # live block table per cache group: read before the next schedule()
    samplers: list[Request] = field(default_factory=list)
    draft_token_ids: list[int] = field(default_factory=list)
    """Speculative decoding: the last ``len(draft_token_ids)`` of the step's tokens are these
    drafts, verified against the logits of every position from the last known token on."""
    earlier: list[tuple[int, int]] = field(default_factory=list)
    """Segment reuse: ranges ``(start, num_tokens)`` the request also computes this step, before
    ``start`` and with reused spans between them (no samples; the runner treats each as a
    sequence of its own with the same block table, all K/V written before any attends)."""

    @property
    def num_step_tokens(self) -> int:
        """Tokens computed this step: ``num_new_tokens`` plus the ``earlier`` ranges'."""
        return self.num_new_tokens + sum(n for _, n in self.earlier)

    @property
    def block_ids(self) -> list[list[int]]:
        """Block ids per cache group."""
        return [[b.block_id for b in t] for t in self.tables]

    @property
    def token_ids(self) -> list[int]:
        """The known input tokens. With async scheduling the last one of a decode may still be
        on the device (sampled by the step in flight) and missing here; read this before that
        step's output is applied."""
        return self.request.all_token_ids[self.start : self.start + self.num_new_tokens]


class Swapper(Protocol):
    """Host memory for preemption by swap. Safety rule: ``swap_out`` reads the blocks at once
    (they are freed right after), ``swap_in`` writes blocks the sequence owns, before the step."""

    def swap_out(self, request_id: str, block_ids: list[int]) -> bool: ...

    def swap_in(self, request_id: str, block_ids: list[int]) -> None: ...

    def drop(self, request_id: str) -> None: ...


@dataclass
class PrefixLoad:
    """Blocks ``block_ids`` of ``request`` are to be filled from the tiers with ``hashes``."""

    request: Request
    block_ids: list[int]
    hashes: list[bytes]


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq]
    copies: list[tuple[int, int, int]]  # (cache group, src block, dst block)
    preempted: list[Request]
    finished_ids: list[str]
    loads: list[PrefixLoad] = field(default_factory=list)
    segment_copies: list[SegmentCopy] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_step_tokens for s in self.seqs)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


class Scheduler:
    """Decides each step which sequences run and how many tokens each computes.

    Running sequences go first (decodes and unfinished prefill chunks), then waiting ones, in
    the order of the ``scheduling_policy``, while the token budget, ``max_num_seqs`` and free
    blocks allow. When blocks run out, the ``preemption_order`` names the victim; its blocks are
    freed (full ones stay cached) and it rejoins the waiting queue, to resume by recompute with
    prefix hits (or by swap-in).

    A decoding request with ``draft_token_ids`` computes them too (speculative decoding, at
    most what the budget, ``max_tokens`` and ``max_model_len`` leave room for; dropped rather
    than preempting anyone); ``update_from_output`` then takes the tokens the target accepted
    plus one, counts only the accepted drafts computed, and frees the blocks past them.

    ``schedule`` counts a step's tokens as computed and its samples as pending
    (``Request.num_pending``) at once; ``update_from_output`` delivers the tokens. So the next
    step may be scheduled before the last one's output is applied (async scheduling). Safety
    rule: at most one step's output is outstanding when scheduling, in the order schedule N+1,
    update N, schedule N+2, so a pending token is known before the step after next.
    """

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.queue_policy = WAITING_POLICIES[config.scheduling_policy](config)
        self.victim_order = VICTIM_ORDERS[config.preemption_order](config, self.queue_policy)
        self._key = self.queue_policy.key  # bound once: the hot path makes one call per key
        self._victim_key = self.victim_order.key
        self.running: list[Request] = []
        self._waiting: list[tuple[tuple, Request]] = []
        self.requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []
        self.loading: dict[str, Request] = {}
        self.lower_tier_lookup: Callable[[Request, list[bytes]], int | None] | None = None
        """Given a waiting request and its block hashes after its device hit, how many leading
        ones the tiers below hold, or None while that is not known yet (the request then waits,
        as if there were no room now). Called on the engine thread: it must never block on a
        tier (the engine's ``OffloadManager.lookup`` asks on its I/O thread and remembers)."""
        self.swapper: Swapper | None = None
        """Set for preemption by swap: a victim's computed blocks go to host memory and come back."""
        self.segments = (SegmentReuse(kv, config.segment_recompute, header_mode=config.segment_header)
                         if config.segment_reuse else None)
        """Segment reuse's planner (its ``header`` is the engine's to set), or None."""
        self._segment_copies: list[SegmentCopy] = []
        self.num_steps = 0

    # -- queue management ----------------------------------------------------------------
    def num_waiting(self) -> int:
        return len(self._waiting)

    def has_unfinished(self) -> bool:
        return bool(self.running or self._waiting or self.loading)

    def _seats(self, req: Request) -> int:
        """Sequences ``req`` counts against ``max_num_seqs``: all ``n`` of a prompt that has not
        forked yet (its forks join ``running`` at the end of its prompt), else one."""
        n = req.sampling_params.n
        return n if n > 1 and not req.forked and not req.num_output_tokens else 1

    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        if self._seats(req) > self.config.max_num_seqs:
            raise ValueError(f"n={req.sampling_params.n} exceeds max_num_seqs={self.config.max_num_seqs}: "
                             f"its sequences could never run together")
        self.requests[req.request_id] = req
        req.prompt_hit_tokens = self.kv.longest_hit_tokens(req, req.num_prompt_tokens - 1)
        req.status = RequestStatus.WAITING
        req.queued_at_step = self.num_steps
        heapq.heappush(self._waiting, (self._key(req), req))
        if self.segments is not None and req.segments and not req.needs_all_prompt_positions:
            for fill in self.segments.fills(req):
                self.kv.counters.segment_fills += 1
                self.add_request(fill)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Finish (or abort) a sequence wherever it is; frees its blocks at once."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status == RequestStatus.LOADING:
            del self.loading[req.request_id]
        elif req.status == RequestStatus.WAITING:
            self._waiting = [(k, r) for k, r in self._waiting if r is not req]
            heapq.heapify(self._waiting)
        req.status = status
        if req.prefill_only and self.segments is not None:
            self.segments.fill_done(req)
        if req.swapped_tokens and self.swapper is not None:
            self.swapper.drop(req.request_id)
            req.swapped_tokens = 0
        self.kv.free(req)
        self._finished_ids.append(request_id)
        return req

    # -- scheduling ----------------------------------------------------------------------
    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        req.draft_token_ids = []
        if self.swapper is not None and req.num_computed_tokens:
            n = -(-req.num_computed_tokens // self.kv.block_size)
            if self.swapper.swap_out(req.request_id, self.kv.block_ids(req.request_id)[0][:n]):
                req.swapped_tokens = req.num_computed_tokens
                self.kv.counters.swapped_out_blocks += n
        self.kv.free(req)
        req.reuse_spans = []  # planned again at re-admission (the borrowed sources were released)
        if not req.swapped_tokens:
            req.exact_tokens = None
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        req.queued_at_step = self.num_steps
        self.kv.counters.preemptions += 1
        heapq.heappush(self._waiting, (self._key(req), req))

    def load(self) -> EngineLoad:
        """This engine's load as a router sees it: waiting and running sequences, prompt tokens
        not computed yet (a waiting request's prompt less what the cache held when it arrived),
        and the blocks each running sequence spans (shared ones counted per sequence). O(requests)."""
        bs = self.kv.block_size
        prefill = 0
        for r in self.requests.values():
            left = r.num_prompt_tokens - max(r.num_computed_tokens, r.prompt_hit_tokens)
            if left > 0:
                prefill += left
        active = sum((r.num_tokens + bs - 1) // bs for r in self.running)
        return EngineLoad(self.num_waiting(), len(self.running), prefill, active)

    def waiting_head(self, n: int) -> list[Request]:
        """The first ``n`` waiting requests in queue order that can hit the prefix cache."""
        return [r for _, r in heapq.nsmallest(n, self._waiting) if not r.needs_all_prompt_positions]

    def _waiting_head(self) -> list[Request]:
        """The next ``eviction_lookahead`` waiting requests in queue order, after the one being
        admitted now (still at the head; its own hits are referenced before it allocates)."""
        return self.waiting_head(self.config.eviction_lookahead + 1)

    def schedule(self) -> SchedulerOutput:
        if self.config.eviction_lookahead and self._waiting:
            self.kv.demand = self._waiting_head
        try:
            return self._schedule()
        finally:
            self.kv.end_step()

    def _schedule(self) -> SchedulerOutput:
        self.num_steps += 1
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, ScheduledSeq] = {}
        preempted: list[Request] = []
        self.running.sort(key=self._key)

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            ranges, spans, num_new, extent = self._chunk(req, req.num_computed_tokens, budget)
            if num_new <= 0 or (req.num_pending and req.length_reached_with_pending()):
                i += 1
                continue
            drafts = self._take_drafts(req, num_new, budget)
            while not self.kv.allocate_slots(req, extent + len(drafts)):
                if drafts:  # no room to verify drafts: decode one token rather than preempt
                    drafts = []
                    continue
                if len(self.running) == 1:  # alone and still too big: the pool can never hold it
                    self.finish_request(req.request_id, RequestStatus.FINISHED_LENGTH)
                    break
                victim = max(self.running, key=self._victim_key)
                if victim.request_id in scheduled:
                    budget += scheduled.pop(victim.request_id).num_step_tokens
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                continue  # req itself was preempted; running[i] is now the next one
            if ranges:
                scheduled[req.request_id] = self._reuse(req, spans, ranges)
            else:
                scheduled[req.request_id] = self._scheduled(req, num_new, drafts)
            budget -= num_new + len(drafts)
            i += 1

        loads: list[PrefixLoad] = []
        if not preempted:
            if self.queue_policy.reorders:
                self._waiting = self.queue_policy.reorder(self._waiting, self.kv, self.num_steps)
            seats = sum(self._seats(r) for r in self.running) + sum(self._seats(r) for r in self.loading.values())
            while self._waiting and budget > 0:
                _, req = self._waiting[0]
                if seats + self._seats(req) > self.config.max_num_seqs:
                    break  # room is kept for every fork of an admitted n > 1 prompt
                if req.num_pending:
                    break  # preempted with a token in flight: it is known by the next schedule
                if req.swapped_tokens:
                    if not self._swap_in(req, budget):
                        break
                    seats += self._seats(req)
                    scheduled[req.request_id] = self._scheduled(req, min(req.num_tokens - req.num_computed_tokens, budget))
                    budget -= scheduled[req.request_id].num_new_tokens
                    continue
                if req.needs_all_prompt_positions:  # prompt logprobs: compute every position
                    hit_blocks, hit_tokens = None, 0  # (its blocks are still cached for others)
                else:
                    hit_blocks, hit_tokens = self.kv.get_computed_blocks(req)
                if (self.lower_tier_lookup is not None and self.kv.enable_caching
                        and not req.needs_all_prompt_positions):
                    load = self._admit_with_load(req, hit_blocks, hit_tokens)
                    if load is False:
                        break
                    if load is not None:
                        loads.append(load)
                        seats += self._seats(req)
                        continue
                if self.segments is not None and req.segments and not req.needs_all_prompt_positions:
                    self.segments.plan(req, hit_tokens)
                ranges, spans, num_new, extent = self._chunk(req, hit_tokens, budget)
                if not self.kv.allocate_slots(req, extent, hit_blocks):
                    if req.reuse_spans:
                        self.kv.release_borrowed(req.request_id)
                        req.reuse_spans, req.exact_tokens = [], None
                    if not self.running:  # even an empty pool cannot hold it: it can never run
                        self.finish_request(req.request_id, RequestStatus.FINISHED_LENGTH)
                        continue
                    break
                heapq.heappop(self._waiting)
                if not req.needs_all_prompt_positions:  # no lookup was made (as vLLM counts)
                    self.kv.record_prefix_query(req.num_tokens, hit_tokens)
                req.num_computed_tokens = hit_tokens
                if req.num_cached_tokens < 0:
                    req.num_cached_tokens = hit_tokens
                    req.cached_by_source = {"device": hit_tokens}
                if req.reuse_spans:
                    self._count_reuse(req)
                if req.max_computed_tokens > hit_tokens:
                    self.kv.counters.recomputed_tokens += req.max_computed_tokens - hit_tokens
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                seats += self._seats(req)
                scheduled[req.request_id] = self._reuse(req, spans, ranges) if ranges else self._scheduled(req, num_new)
                budget -= num_new

        for req in self.running:  # drafts are for this step only (unscheduled ones are dropped)
            if req.draft_token_ids:
                req.draft_token_ids = []
        seqs = list(scheduled.values())
        for s in seqs:
            self._fork_if_needed(s)
        for s in seqs:  # the step's tokens count as computed and its samples as pending now,
            req = s.request  # so the next step can be scheduled before this one's output is in
            req.num_computed_tokens = s.start + s.num_new_tokens - len(s.draft_token_ids)
            req.max_computed_tokens = max(req.max_computed_tokens, req.num_computed_tokens)
            for target in s.samplers:
                target.num_pending += 1
        finished, self._finished_ids = self._finished_ids, []
        segment_copies, self._segment_copies = self._segment_copies, []
        return SchedulerOutput(seqs=seqs, copies=self.kv.take_copies(), preempted=preempted,
                               finished_ids=finished, loads=loads, segment_copies=segment_copies)

    @staticmethod
    def _chunk(req: Request, pos: int, budget: int) -> tuple[list[tuple[int, int]], int, int, int]:
        """What ``req``, computed up to ``pos``, does this step: (ranges it computes around its
        reused spans, spans reused, tokens computed, tokens from ``pos`` to the last range's
        end). Without pending reuse spans: no ranges, one plain chunk."""
        if not req.reuse_spans:
            n = min(req.num_tokens - pos, budget)
            if req.media:
                n = media_chunk_end(req.media, pos, pos + n) - pos
            return NO_RANGES, 0, n, n
        ranges, spans = SegmentReuse.chunk(req, pos, budget)
        start, n = ranges[-1]
        return ranges, spans, sum(k for _, k in ranges), start + n - pos

    def _reuse(self, req: Request, spans: int, ranges: list[tuple[int, int]]) -> ScheduledSeq:
        """``req`` computes ``ranges`` this step (``SegmentReuse.chunk``, allocated by now) and
        takes its first ``spans`` reuse spans from their sources (copies before the forward)."""
        assert self.segments is not None
        self._segment_copies += self.segments.copies(req, req.reuse_spans[:spans])
        del req.reuse_spans[:spans]
        start, n = ranges[-1]
        req.num_computed_tokens = start
        s = self._scheduled(req, n)
        s.earlier = ranges[:-1]
        return s

    def _count_reuse(self, req: Request) -> None:
        """Count a fresh plan's spans: segment hits, reused and recomputed tokens, and the
        reused tokens among the request's cached ones (the first admission's only)."""
        c, reused = self.kv.counters, sum(s.length for s in req.reuse_spans)
        c.segment_hits += len(req.reuse_spans)
        c.segment_reused_tokens += reused
        c.segment_recomputed_tokens += sum(s.recomputed for s in req.reuse_spans)
        if not req.num_preemptions and req.cached_by_source.get("segment") is None:
            req.num_cached_tokens += reused
            req.cached_by_source["segment"] = reused

    def _swap_in(self, req: Request, budget: int) -> bool:
        """Re-admit a swapped-out sequence: fresh blocks, its KV copied back from host memory."""
        swapped = req.swapped_tokens
        if not self.kv.allocate_slots(req, swapped + min(req.num_tokens - swapped, budget)):
            return False
        heapq.heappop(self._waiting)
        n = -(-swapped // self.kv.block_size)
        assert self.swapper is not None
        self.swapper.swap_in(req.request_id, self.kv.block_ids(req.request_id)[0][:n])
        self.kv.counters.swapped_in_blocks += n
        req.num_computed_tokens, req.swapped_tokens = swapped, 0
        self.kv.cache_blocks(req)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        return True

    def _admit_with_load(self, req: Request, hit_blocks, hit_tokens: int) -> PrefixLoad | None | bool:
        """If tiers below hold more of ``req``'s prefix, admit it in the LOADING state with
        blocks for that prefix (None: nothing below; False: no room now, or the tiers' answer is
        not in yet: the request waits at the head, asked, and later ones are asked meanwhile)."""
        bs = self.kv.block_size
        hashes = self._lower_hashes(req, hit_tokens)
        extra = self.lower_tier_lookup(req, hashes) if hashes else 0  # type: ignore[misc]
        if extra is None:  # asked; FCFS: later requests do not overtake it meanwhile
            self._ask_ahead(req)
            return False
        if not extra:
            return None
        if not self.kv.allocate_slots(req, extra * bs, hit_blocks):
            return False
        heapq.heappop(self._waiting)
        req.num_computed_tokens = hit_tokens
        if req.num_cached_tokens < 0:
            req.cached_by_source = {"device": hit_tokens}
        req.status = RequestStatus.LOADING
        self.loading[req.request_id] = req
        table = self.kv.block_tables(req.request_id)[0]
        ids = [b.block_id for b in table[hit_tokens // bs: hit_tokens // bs + extra]]
        return PrefixLoad(req, ids, hashes[:extra])

    def _lower_hashes(self, req: Request, hit_tokens: int) -> list[bytes]:
        """``req``'s block hashes after a device hit of ``hit_tokens``, up to its last token's."""
        bs = self.kv.block_size
        return self.kv.block_hashes(req)[hit_tokens // bs: (req.num_tokens - 1) // bs]

    LOOKUP_AHEAD = 32

    def _ask_ahead(self, head: Request) -> None:
        """While ``head``'s lookup is pending, ask (not admit) for the next waiting requests
        that could join it, so a burst is admitted together once the answers are in rather than
        one request a step. Their device hits may grow before they are admitted: the lookup
        then answers from what it asked when it can, or asks again."""
        seats = self.config.max_num_seqs - len(self.running) - len(self.loading) - self._seats(head)
        if seats <= 0:
            return
        for _, r in heapq.nsmallest(min(seats, self.LOOKUP_AHEAD) + 1, self._waiting)[1:]:
            if r is head or r.needs_all_prompt_positions or r.swapped_tokens or r.num_pending:
                continue
            hashes = self._lower_hashes(r, self.kv.longest_hit_tokens(r, r.num_tokens - 1))
            if hashes:
                self.lower_tier_lookup(r, hashes)  # type: ignore[misc]

    def finish_loading(self, req: Request, loaded_by_source: list[str]) -> None:
        """The first ``len(loaded_by_source)`` blocks of a PrefixLoad hold verified KV now: count
        them computed and cached, and let the request run (the rest of its prompt is computed)."""
        if self.loading.pop(req.request_id, None) is None:
            return  # aborted meanwhile
        bs = self.kv.block_size
        hit_device = req.num_computed_tokens
        req.num_computed_tokens += len(loaded_by_source) * bs
        if req.num_cached_tokens < 0:
            for src in loaded_by_source:
                req.cached_by_source[src] = req.cached_by_source.get(src, 0) + bs
        self.kv.cache_blocks(req, adopted=True)  # the tiers' own copies: nothing to write through
        self.kv.record_prefix_query(req.num_tokens, req.num_computed_tokens)
        self.kv.counters.tier_hits_tokens += req.num_computed_tokens - hit_device
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = req.num_computed_tokens
        if req.max_computed_tokens > req.num_computed_tokens:
            self.kv.counters.recomputed_tokens += req.max_computed_tokens - req.num_computed_tokens
        if self.segments is not None and req.segments and self.segments.plan(req, req.num_computed_tokens):
            self._count_reuse(req)
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    def _take_drafts(self, req: Request, num_new: int, budget: int) -> list[int]:
        """The drafts ``req`` verifies this step (its ``draft_token_ids``, consumed): only when it
        decodes one known token after its first output token (the prompt's last token is a
        prefill step, where ``n > 1`` forks), cut to the budget left after that token and to
        one fewer than the tokens ``max_tokens`` and ``max_model_len`` still allow (the verify
        step yields one more than it accepts)."""
        drafts = req.draft_token_ids
        if not drafts:
            return drafts  # the common case (no speculation): no allocation on the hot path
        req.draft_token_ids = []
        if (num_new != 1 or req.num_pending or req.num_computed_tokens != req.num_tokens - 1
                or not req.num_output_tokens):
            return []
        room = min(budget - 1, req.max_model_len - req.num_tokens - 1)
        max_tokens = req.sampling_params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - req.num_output_tokens - 1)
        return drafts[:max(0, room)]

    def _scheduled(self, req: Request, num_new: int, drafts: list[int] | None = None) -> ScheduledSeq:
        start = req.num_computed_tokens
        samples = start + num_new == req.num_tokens and not req.prefill_only
        drafts = drafts or []
        return ScheduledSeq(req, start, num_new + len(drafts), self.kv.block_tables(req.request_id),
                            [req] if samples else [], drafts)

    def _fork_if_needed(self, s: ScheduledSeq) -> None:
        """At the end of an ``n > 1`` prompt, share its blocks with ``n - 1`` new sequences;
        all ``n`` are sampled from this step's logits."""
        req = s.request
        n = req.sampling_params.n
        if not s.samplers or n == 1 or req.forked or req.num_output_tokens:
            return
        req.forked = True
        for index in range(1, n):
            child = req.fork(index)
            child.num_computed_tokens = s.start + s.num_new_tokens
            child.status = RequestStatus.RUNNING
            self.kv.fork(req, child)
            self.requests[child.request_id] = child
            self.running.append(child)
            s.samplers.append(child)

    # -- after the forward ---------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, int | list[int]]) -> list[Request]:
        """Register the step's full blocks, deliver its sampled (pending) tokens, finish
        sequences that hit a token-level stop. A sequence that verified drafts gets a list: the
        drafts accepted, then the target's own token. Returns the sequences that received a token. A
        target preempted after this step was scheduled (async scheduling) still gets its token:
        it was sampled from complete KV."""
        got_token = []
        for s in out.seqs:
            req = s.request
            if s.draft_token_ids:
                self._deliver_verified(req, sampled.get(req.request_id), got_token)
                continue
            if req.status == RequestStatus.RUNNING:
                self.kv.cache_blocks(req, s.start + s.num_new_tokens)
                if req.exact_tokens is not None and not req.reuse_spans:
                    self.kv.release_borrowed(req.request_id)  # the steps that read them have run
                if req.prefill_only and s.start + s.num_new_tokens >= req.num_tokens:
                    self.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)
            for target in s.samplers:
                if target.is_finished or target.request_id not in sampled:
                    continue
                target.append_token(sampled[target.request_id])
                got_token.append(target)
                status = target.check_stop()
                if status is not None:
                    self.finish_request(target.request_id, status)
        return got_token

    def _deliver_verified(self, req: Request, tokens: int | list[int] | None, got_token: list[Request]) -> None:
        """Apply a verify step: ``tokens`` are the accepted drafts then one token of the target
        (a verify step is never in flight behind another: speculative steps run synchronously).
        The accepted drafts' KV was written by the step, so they count as computed; blocks past
        the sequence's tokens held only rejected drafts and go back to the pool unregistered;
        only then are full blocks registered, so no unverified token is ever in the index."""
        if tokens is None or req.is_finished:
            return
        if isinstance(tokens, int):
            tokens = [tokens]
        req.num_computed_tokens += len(tokens) - 1
        req.max_computed_tokens = max(req.max_computed_tokens, req.num_computed_tokens)
        got_token.append(req)
        for tok in tokens:
            req.append_token(tok)
            status = req.check_stop()
            if status is not None:
                self.finish_request(req.request_id, status)
                return
        self.kv.trim(req)
        self.kv.cache_blocks(req)
