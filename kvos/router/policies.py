"""Routing policies: which of several engines serves a request. Pure Python (no torch), plain
values in and out, so the same classes drive the fleet simulator and a multi-engine front end.

A router sees a request as the chained hashes of its full prompt blocks, computed with the
request's own root (model and tenant salt: ``kvos.cache.hashing.root_hash``), so a tenant's
blocks match only that tenant's blocks on whatever engine holds them (invariant 4 holds across
engines). It sees engines through ``EngineLoad`` figures and, for ``kv_aware``, their KV event
batches. Engines are numbered ``0 .. num_engines - 1``; removing one keeps the numbers of the
others (its slot just stops being chosen).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict

from kvos.core.kv_events import CachedBlockSet, KVEventBatch, KVSnapshot
from kvos.core.load import EngineLoad
from kvos.core.registry import Registry

BlockHash = bytes

DEFAULT_KV_WEIGHT = 64.0
"""kv_aware's default overlap weight (Dynamo's is 1; figures: benchmarks/routing.md)."""

DEFAULT_QUEUE_WEIGHT = 0.1
"""What a block of an engine's pending prefill costs, against a block of the request's own
prefill (Dynamo's cost: 1): low, so that a request stays with its cached prefix behind a
longer queue (figures: benchmarks/policies.md, benchmarks/routing.md)."""

DEFAULT_BALANCE_ABS = 16
DEFAULT_BALANCE_REL = 3.0
"""kv_aware's balance guard: an engine with more than ``DEFAULT_BALANCE_ABS`` requests (waiting
and running) over the least loaded one, and over ``DEFAULT_BALANCE_REL`` times its count, is
not chosen, whatever it holds. Loose, so that a conversation stays with its own prefix; hot
shared prefixes spread by the tighter guard below (figures: benchmarks/policies.md)."""
DEFAULT_BALANCE = (DEFAULT_BALANCE_ABS, DEFAULT_BALANCE_REL)

DEFAULT_SHARED_BALANCE = (8, 2.0)
DEFAULT_SHARED_THRESHOLD = 8
"""kv_aware's second balance guard, for shared prefixes only (``KVAware``): an engine over
``DEFAULT_SHARED_BALANCE`` is also left out where the request's cached prefix there is shared,
its last block in more than ``DEFAULT_SHARED_THRESHOLD`` earlier routed requests (0: the guard
is off), so hot system prompts that first landed unevenly spread (figures: benchmarks/policies.md)."""

DEFAULT_SOLE_MARGIN = 2
"""kv_aware's sole-holder rule (``KVAware``): an engine holding at least this many more of the
request's leading blocks than every other, and allowed by both guards, is chosen whatever its
queue (0: off). Simulated, 8 engines of 64 sequences against one engine with all the memory:
the conversation trace whole 0.962 -> 0.995, the other rows within +-0.01 (figures:
benchmarks/policies.md)."""


def balance_error(balance_abs: int, balance_rel: float) -> str | None:
    """What is wrong with a balance guard's thresholds (None: nothing)."""
    if balance_abs < 0:
        return f"balance_abs must be >= 0, got {balance_abs}"
    if balance_rel != 0 and balance_rel < 1:
        return f"balance_rel must be 0 (off) or >= 1, got {balance_rel}"
    return None


class Router(ABC):
    """Chooses an engine per request. Hooks keep the router's view current; each is called on
    the router's thread, in the order things happened on the engines (per engine, batches in
    sequence order). ``choose`` never returns a removed engine; it raises when none is left."""

    name = "router"
    needs_loads = True
    """Whether ``choose`` reads ``loads`` (a caller may pass an empty list otherwise)."""
    uses_events = False
    """Whether the router reads KV events (a caller need not publish them otherwise)."""

    @classmethod
    def create(cls, num_engines: int, block_size: int, capacity_blocks: int, **settings) -> Router:
        """A router of this class from ``make_router``'s arguments; ``settings`` are kv_aware's
        keywords (``KVAware.__init__``), which a class that takes none ignores. Override when the
        constructor takes any beyond the engines and the block size."""
        return cls(num_engines, block_size)

    def __init__(self, num_engines: int, block_size: int = 16) -> None:
        if num_engines < 1:
            raise ValueError(f"num_engines must be >= 1, got {num_engines}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.live: list[bool] = [True] * num_engines
        self.routed: list[int] = [0] * num_engines
        """Requests routed to each engine (``on_routed``): the last tie-break before the engine's
        number, so that ties (e.g. requests that arrive one at a time, each finding every engine
        idle) spread over the engines instead of all landing on engine 0."""

    @property
    def num_engines(self) -> int:
        return len(self.live)

    def _live(self) -> list[int]:
        engines = [e for e, ok in enumerate(self.live) if ok]
        if not engines:
            raise RuntimeError("route: no engine is left")
        return engines

    @abstractmethod
    def choose(self, request_hashes: list[BlockHash], loads: list[EngineLoad]) -> int:
        """The engine for a request whose full prompt blocks hash to ``request_hashes``;
        ``loads[e]`` is engine ``e``'s load now. Does not record the choice (``on_routed`` does)."""

    def predicted_hits(self, engine: int, request_hashes: list[BlockHash]) -> int:
        """Leading blocks of the request the router believes ``engine`` holds (0: it does not know)."""
        return 0

    def on_routed(self, engine: int, request_hashes: list[BlockHash]) -> None:
        """The request was sent to ``engine``."""
        self.routed[engine] += 1

    def on_events(self, engine: int, batch: KVEventBatch) -> bool:
        """``engine`` published ``batch``. False: the view of that engine is stale (a batch was
        missed) and stays so until ``on_snapshot``."""
        return True

    def on_snapshot(self, engine: int, snap: KVSnapshot) -> None:
        """``engine``'s whole cache as of batch ``snap.seq``."""

    def on_engine_added(self) -> int:
        """A new engine joins, with an empty cache; returns its number."""
        self.live.append(True)
        self.routed.append(0)
        return len(self.live) - 1

    def on_engine_removed(self, engine: int) -> None:
        """``engine`` is gone: never chosen again, and what the router knew of it is dropped."""
        self.live[engine] = False


ROUTERS: Registry[type[Router]] = Registry("router")
"""Routers by name, filled by ``register_router``: the choices of ``--router``."""
register_router = ROUTERS.register


@register_router
class RoundRobin(Router):
    """Live engines in turn: ``0, 1, ..., n-1, 0, ...`` (skipping removed ones), blind to load
    and cache."""

    name = "round_robin"
    needs_loads = False

    def __init__(self, num_engines: int, block_size: int = 16) -> None:
        super().__init__(num_engines, block_size)
        self._next = 0

    def choose(self, request_hashes: list[BlockHash], loads: list[EngineLoad]) -> int:
        self._live()
        while not self.live[self._next % self.num_engines]:
            self._next += 1
        e = self._next % self.num_engines
        self._next = e + 1
        return e


@register_router
class LeastLoaded(Router):
    """The engine with the least ``EngineLoad.blocks`` (prefill tokens in blocks plus active
    blocks); ties go to fewer requests (waiting + running), then fewer routed so far, then the
    lower number. Blind to
    the cache."""

    name = "least_loaded"

    def choose(self, request_hashes: list[BlockHash], loads: list[EngineLoad]) -> int:
        bs = self.block_size
        return min(self._live(), key=lambda e: (loads[e].blocks(bs), loads[e].waiting + loads[e].running,
                                                self.routed[e], e))


@register_router
class KVAware(Router):
    """NVIDIA Dynamo's KV-router cost, on an index per engine built from its KV events.

    For a request of ``R`` full prompt blocks, engine ``e`` costs
    ``overlap_weight * (queue_weight * P_e + R - H_e) + A_e`` where ``H_e`` is the leading
    blocks of the request ``e``'s index holds, ``P_e`` its pending prefill in blocks
    (``prefill_tokens / block_size``) and ``A_e`` its active blocks: the prefill it would have
    to do, weighed against what it is decoding. With ``queue_weight`` 1 this is Dynamo's cost;
    below 1 a request stays with its prefix behind a longer queue (``DEFAULT_QUEUE_WEIGHT``).
    The lowest cost wins; ties go to the lower ``EngineLoad.blocks``, then fewer routed so far,
    then the lower number. ``overlap_weight`` 0 balances active blocks only (with the sole-holder
    rule below off); larger values favour cache hits and a short prefill queue (TTFT) over decode
    load.

    Balance guard (``balance`` as ``(balance_abs, balance_rel)``; ``DEFAULT_BALANCE``): engines whose
    requests (waiting + running) exceed the least loaded engine's by more than ``balance_abs``
    and by a factor over ``balance_rel`` are left out before the cost is compared; the least
    loaded engine is never left out. ``balance_rel`` 0 turns the guard off.

    Shared-prefix guard (``shared_balance`` as ``(abs, rel)``, ``shared_threshold`` ``T``;
    ``DEFAULT_SHARED_THRESHOLD``): with ``T`` > 0, an engine over the second guard
    ``shared_balance`` (the same rule, computed over the live engines) is also left out when the
    request's cached prefix there is shared: the last of its ``H_e`` blocks was in more than
    ``T`` earlier routed requests (to any engine). A hot system prompt is cheap to compute once
    more on a less loaded engine; a conversation's own history (in few requests) is not, so a
    loose ``balance`` keeps conversations with their prefix while a tight ``shared_balance``
    still spreads hot prompts. The least loaded engine passes both guards, so one is always
    left. ``T`` 0 (or None) turns it off and keeps no counts.

    Sole-holder rule (``sole_margin`` ``M``; ``DEFAULT_SOLE_MARGIN``): with ``M`` > 0, when one
    live engine holds at least ``M`` more of the request's leading blocks than every other and
    both guards leave it in, it is chosen whatever the cost says (its queue): the request's own
    history lives there, and sending it elsewhere recomputes those blocks and leaves a copy on
    two engines. ``M`` 0 turns it off; it also stands aside while any live engine's index is
    stale (that engine counts 0 hits, so another could look like the sole holder).

    Invariants: ``index[e]`` equals engine ``e``'s prefix index after the last batch applied,
    unless ``stale[e]`` (a batch was missed), in which case ``H_e`` counts 0 until a snapshot.
    ``uses[h]`` counts the routed requests whose prompt held block ``h`` since ``h`` last
    entered ``uses``; ``len(uses) <= capacity_blocks * num_engines`` (engine slots, removed ones
    included), the least recently routed hashes dropped first (a dropped hash counts 0 again);
    ``on_routed`` costs O(len(request_hashes)) amortized. A removed engine's blocks keep their
    counts: they count requests, not engines.
    """

    name = "kv_aware"
    uses_events = True

    @classmethod
    def create(cls, num_engines: int, block_size: int, capacity_blocks: int, **settings) -> Router:
        return cls(num_engines, block_size, capacity_blocks=capacity_blocks, **settings)

    def __init__(self, num_engines: int, block_size: int = 16, overlap_weight: float = DEFAULT_KV_WEIGHT,
                 queue_weight: float = DEFAULT_QUEUE_WEIGHT, balance: tuple[int, float] = DEFAULT_BALANCE,
                 shared_balance: tuple[int, float] = DEFAULT_SHARED_BALANCE,
                 shared_threshold: int | None = DEFAULT_SHARED_THRESHOLD, sole_margin: int = DEFAULT_SOLE_MARGIN,
                 capacity_blocks: int = 2000) -> None:
        super().__init__(num_engines, block_size)
        balance_abs, balance_rel = balance
        if overlap_weight < 0:
            raise ValueError(f"overlap_weight must be >= 0, got {overlap_weight}")
        if queue_weight < 0:
            raise ValueError(f"queue_weight must be >= 0, got {queue_weight}")
        if (err := balance_error(balance_abs, balance_rel)) is not None:
            raise ValueError(err)
        if (err := balance_error(*shared_balance)) is not None:
            raise ValueError(f"shared_balance: {err}")
        if shared_threshold is not None and shared_threshold < 0:
            raise ValueError(f"shared_threshold must be >= 0 (0: off), got {shared_threshold}")
        if sole_margin < 0:
            raise ValueError(f"sole_margin must be >= 0 (0: off), got {sole_margin}")
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        self.overlap_weight = overlap_weight
        self.queue_weight = queue_weight
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.shared_balance = tuple(shared_balance)
        self.shared_threshold = shared_threshold or 0
        self.sole_margin = sole_margin
        self.capacity_blocks = capacity_blocks
        self.uses: OrderedDict[BlockHash, int] = OrderedDict()
        """Routed requests per prompt block hash, least recently routed first (the shared-prefix
        guard's counts; empty while it is off)."""
        self.index: list[CachedBlockSet] = [CachedBlockSet() for _ in range(num_engines)]
        self.stale: list[bool] = [False] * num_engines

    def predicted_hits(self, engine: int, request_hashes: list[BlockHash]) -> int:
        if self.stale[engine] or not self.live[engine]:
            return 0
        return self.index[engine].prefix_hits(request_hashes)

    def cost(self, engine: int, request_hashes: list[BlockHash], load: EngineLoad, hits: int | None = None) -> float:
        """The class docstring's cost; ``hits``: ``predicted_hits(engine, request_hashes)`` if known."""
        hits = self.predicted_hits(engine, request_hashes) if hits is None else hits
        prefill = self.queue_weight * load.prefill_tokens / self.block_size + len(request_hashes) - hits
        return self.overlap_weight * prefill + load.active_blocks

    def balanced(self, engines: list[int], loads: list[EngineLoad],
                 guard: tuple[int, float] | None = None) -> list[int]:
        """``engines`` less those the balance guard (``guard``, default ``balance_abs``,
        ``balance_rel``) leaves out (the class docstring's rule)."""
        balance_abs, balance_rel = guard if guard is not None else (self.balance_abs, self.balance_rel)
        if not balance_rel:
            return engines
        n = {e: loads[e].waiting + loads[e].running for e in engines}
        least = min(n.values())
        return [e for e in engines if n[e] - least <= balance_abs or n[e] <= balance_rel * least]

    def shared_prefix(self, engine: int, request_hashes: list[BlockHash], hits: int | None = None) -> bool:
        """Whether the request's cached prefix on ``engine`` is shared: its last block was in
        more than ``shared_threshold`` earlier routed requests (False with no prefix there).
        ``hits``: ``predicted_hits(engine, request_hashes)`` if known."""
        hits = self.predicted_hits(engine, request_hashes) if hits is None else hits
        return hits > 0 and self.uses.get(request_hashes[hits - 1], 0) > self.shared_threshold

    def _hits(self, request_hashes: list[BlockHash], hits: dict[int, int] | None) -> dict[int, int]:
        """``predicted_hits`` of every live engine (``hits`` when the caller has them)."""
        return hits if hits is not None else {e: self.predicted_hits(e, request_hashes) for e in self._live()}

    def allowed(self, request_hashes: list[BlockHash], loads: list[EngineLoad],
                hits: dict[int, int] | None = None) -> list[int]:
        """The live engines both guards leave in, in number order (never empty). ``hits``:
        ``predicted_hits`` per live engine if known."""
        live = self._live()
        engines = self.balanced(live, loads)
        if not self.shared_threshold:
            return engines
        hits = self._hits(request_hashes, hits)
        tight = set(self.balanced(live, loads, self.shared_balance))
        return [e for e in engines if e in tight or not self.shared_prefix(e, request_hashes, hits[e])]

    def sole_holder(self, request_hashes: list[BlockHash], hits: dict[int, int] | None = None) -> int | None:
        """The live engine holding at least ``sole_margin`` more of the request's leading blocks
        than every other live engine (None: no such engine, one live engine, a live engine's
        index stale, or the rule off). ``hits``: ``predicted_hits`` per live engine if known."""
        live = self._live()
        if not self.sole_margin or any(self.stale[e] for e in live):
            return None
        hits = self._hits(request_hashes, hits)
        ranked = sorted(((hits[e], e) for e in live), reverse=True)
        if len(ranked) < 2 or ranked[0][0] - ranked[1][0] < self.sole_margin:
            return None
        return ranked[0][1]

    def choose(self, request_hashes: list[BlockHash], loads: list[EngineLoad]) -> int:
        hits = self._hits(request_hashes, None)  # each engine's prefix looked up once per request
        allowed = self.allowed(request_hashes, loads, hits)
        sole = self.sole_holder(request_hashes, hits)
        if sole is not None and sole in allowed:
            return sole
        bs = self.block_size
        return min(allowed, key=lambda e: (self.cost(e, request_hashes, loads[e], hits[e]), loads[e].blocks(bs),
                                           self.routed[e], e))

    def on_routed(self, engine: int, request_hashes: list[BlockHash]) -> None:
        super().on_routed(engine, request_hashes)
        if not self.shared_threshold:
            return
        uses = self.uses
        for h in request_hashes:
            uses[h] = uses.get(h, 0) + 1
            uses.move_to_end(h)
        bound = self.capacity_blocks * self.num_engines
        while len(uses) > bound:
            uses.popitem(last=False)

    def on_events(self, engine: int, batch: KVEventBatch) -> bool:
        if self.stale[engine]:
            return False
        if not self.index[engine].apply(batch):
            self.stale[engine] = True
            return False
        return True

    def on_snapshot(self, engine: int, snap: KVSnapshot) -> None:
        self.index[engine].reset(snap)
        self.stale[engine] = False

    def on_engine_added(self) -> int:
        self.index.append(CachedBlockSet())
        self.stale.append(False)
        return super().on_engine_added()

    def on_engine_removed(self, engine: int) -> None:
        super().on_engine_removed(engine)
        self.index[engine] = CachedBlockSet()


@register_router
class Approx(KVAware):
    """``kv_aware``'s cost without events: ``H_e`` comes from the router's own record of the
    prompt blocks it sent to each engine, an LRU of at most ``capacity_blocks`` hashes per
    engine (sending a request refreshes its blocks; the oldest fall out), as an engine's LRU
    pool of that many blocks would keep them.

    Invariant: ``len(sent[e]) <= capacity_blocks``; ``sent[e]`` holds the most recently sent
    distinct hashes to ``e``, most recent last."""

    name = "approx"
    uses_events = False

    def __init__(self, num_engines: int, block_size: int = 16, **settings) -> None:
        """``settings``: ``KVAware``'s keywords; ``capacity_blocks`` also bounds ``sent[e]``."""
        super().__init__(num_engines, block_size, **settings)
        self.sent: list[OrderedDict[BlockHash, None]] = [OrderedDict() for _ in range(num_engines)]

    def predicted_hits(self, engine: int, request_hashes: list[BlockHash]) -> int:
        if not self.live[engine]:
            return 0
        sent = self.sent[engine]
        n = 0
        for h in request_hashes:
            if h not in sent:
                break
            n += 1
        return n

    def on_routed(self, engine: int, request_hashes: list[BlockHash]) -> None:
        super().on_routed(engine, request_hashes)
        sent = self.sent[engine]
        for h in request_hashes:
            sent[h] = None
            sent.move_to_end(h)
        while len(sent) > self.capacity_blocks:
            sent.popitem(last=False)

    def on_events(self, engine: int, batch: KVEventBatch) -> bool:
        return True

    def on_snapshot(self, engine: int, snap: KVSnapshot) -> None:
        pass

    def on_engine_added(self) -> int:
        self.sent.append(OrderedDict())
        return super().on_engine_added()

    def on_engine_removed(self, engine: int) -> None:
        super().on_engine_removed(engine)
        self.sent[engine] = OrderedDict()


def make_router(name: str, num_engines: int, block_size: int = 16, capacity_blocks: int = 2000,
                **settings) -> Router:
    """A router by name (``ROUTERS``) for ``num_engines`` engines of ``block_size``-token blocks
    holding ``capacity_blocks`` each (what approx remembers per engine, and the shared-prefix
    guard's counts per engine). ``settings`` are kv_aware's and approx's keywords
    (``KVAware.__init__``: ``overlap_weight``, ``queue_weight``, ``balance``, ``shared_balance``,
    ``shared_threshold``, ``sole_margin``); the other routers ignore them."""
    cls = ROUTERS.get(name)
    if cls is None:
        raise ValueError(f"router must be one of {', '.join(ROUTERS)}, got {name!r}")
    return cls.create(num_engines, block_size, capacity_blocks, **settings)
