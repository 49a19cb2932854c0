"""Replays a workload through the engine's own Scheduler and KV memory system, with a cost model
in place of the model (the SimExecutor)."""
from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field, fields

from tqdm.auto import tqdm

from kvos.cache.eviction import EVICTION_POLICIES, BeladyPolicy, make_policy
from kvos.cache.full_attention import cdiv
from kvos.cache.hashing import extend_block_hashes, root_hash
from kvos.cache.kv_manager import KVCacheManager
from kvos.cache.layout import CacheLayout
from kvos.cache.spec import FullAttentionSpec
from kvos.config.engine import EngineConfig
from kvos.core.media import MediaItem, media_overlapping
from kvos.core.request import Request
from kvos.core.sampling_params import SamplingParams
from kvos.scheduler.describe import plan_encodings
from kvos.scheduler.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from kvos.sim.contiguous import ContiguousKVManager
from kvos.sim.cost_model import CostModel
from kvos.sim.options import SimOptions
from kvos.sim.tier import CPU_SOURCE, SimTier, SimTierConfig
from kvos.sim.traces import MOONCAKE_BLOCK, TraceRequest

SIM_MODEL_ID = "sim"
SIM_TOKEN = -7  # every simulated output token


def _read(part: str, name: str) -> property:
    return property(lambda self: getattr(getattr(self, part), name), doc=f"``{part}.{name}`` (read-only)")


@dataclass
class SimConfig:
    """A simulated engine: the ``engine``'s settings (block size, pool size, scheduler, eviction;
    ``num_blocks`` None: every request's blocks fit at once, in large pages with ``layout``),
    the simulator's ``options``, a model's cache ``layout`` (``kvos.cache.layout.build_layout``:
    several groups for a hybrid model; None: the abstract spec of one layer, every token one
    slot) and a CPU ``tier`` below the device. The engine's ``eviction_policy`` may name an
    offline policy here (belady). ``of`` builds one from keyword arguments of all four parts."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    options: SimOptions = field(default_factory=SimOptions)
    layout: CacheLayout | None = None
    tier: SimTierConfig | None = None
    """A CPU tier below the device (single cache group, paged allocator only)."""

    block_size = _read("engine", "block_size")
    num_blocks = _read("engine", "num_blocks")
    eviction_policy = _read("engine", "eviction_policy")
    scheduling_policy = _read("engine", "scheduling_policy")
    eviction_lookahead = _read("engine", "eviction_lookahead")
    max_num_batched_tokens = _read("engine", "max_num_batched_tokens")
    max_num_seqs = _read("engine", "max_num_seqs")
    max_model_len = _read("engine", "max_model_len")
    enable_prefix_caching = _read("engine", "enable_prefix_caching")
    allocator = _read("options", "allocator")
    time_scale = _read("options", "time_scale")

    @staticmethod
    def _split(kw: dict) -> tuple[dict, dict, dict]:
        """``kw`` as (``EngineConfig``, ``SimOptions``, own) keyword arguments; an unknown name
        is a TypeError."""
        engine_names = {f.name for f in fields(EngineConfig)}
        option_names = {f.name for f in fields(SimOptions)}
        unknown = sorted(set(kw) - engine_names - option_names - {"layout", "tier"})
        if unknown:
            raise TypeError(f"SimConfig has no setting {unknown[0]!r}")
        return ({k: v for k, v in kw.items() if k in engine_names},
                {k: v for k, v in kw.items() if k in option_names},
                {k: v for k, v in kw.items() if k in ("layout", "tier")})

    @classmethod
    def of(cls, **kw) -> SimConfig:
        """A config from keyword arguments of ``EngineConfig``, ``SimOptions`` and ``layout``/
        ``tier`` (each name goes to the part that has it; the rest are the parts' defaults)."""
        engine, options, own = cls._split(kw)
        return cls(EngineConfig(**engine), SimOptions(**options), **own)

    def replace(self, **kw) -> SimConfig:
        """This config with the settings in ``kw`` changed (names as in ``of``)."""
        engine, options, own = self._split(kw)
        return dataclasses.replace(self, engine=dataclasses.replace(self.engine, **engine),
                                   options=dataclasses.replace(self.options, **options), **own)

    def scheduler_config(self) -> SchedulerConfig:
        """The engine's scheduler settings; the offline optimum knows every next use, so it runs
        without eviction lookahead."""
        sc = self.engine.scheduler_config()
        return dataclasses.replace(sc, eviction_lookahead=0) if EVICTION_POLICIES[self.eviction_policy].offline else sc

    def __post_init__(self) -> None:
        if self.layout is not None and self.layout.block_size != self.block_size:
            raise ValueError(f"block_size {self.block_size} differs from the layout's {self.layout.block_size}")
        if self.layout is not None and self.allocator == "contiguous" and (
                len(self.layout.groups) != 1 or self.layout.groups[0].spec.kind != "full_attention"):
            raise ValueError("allocator 'contiguous' reserves every layer's KV for the whole length: "
                             "it needs kv_layout 'homogeneous'")
        if self.layout is not None and len(self.layout.groups) > 1 and self.eviction_policy == "belady":
            raise ValueError(f"eviction_policy 'belady' needs a single cache group; kv_layout "
                             f"{self.layout.mode!r} has {len(self.layout.groups)} (use 'homogeneous', or "
                             f"another policy)")
        if self.tier is not None and (self.allocator != "paged" or not self.enable_prefix_caching or (
                self.layout is not None and len(self.layout.groups) > 1)):
            raise ValueError("tier: a CPU tier needs the paged allocator, prefix caching and a single cache group")


def window_pairs(start: int, end: int, window: int) -> int:
    """Query-key pairs of positions ``[start, end)`` when each query sees at most ``window``
    keys (itself included): ``sum(min(p + 1, window))``."""
    m = max(start, min(end, window))
    return (m * (m + 1) - start * (start + 1)) // 2 + max(0, end - max(start, window)) * window


class SimExecutor:
    """Stands in for the model runner: a step's duration from the cost model, one synthetic
    token per sampled sequence."""

    def __init__(self, cost: CostModel) -> None:
        self.cost = cost

    def execute(self, out: SchedulerOutput) -> tuple[dict[str, int], float]:
        tokens = context = pairs = w_context = w_pairs = 0
        window = self.cost.sliding_window if self.cost.sliding_fraction else None
        sampled: dict[str, int] = {}
        for s in out.seqs:
            for start, n in [*s.earlier, (s.start, s.num_new_tokens)]:
                end = start + n
                tokens += n
                context += end
                pairs += n * (start + end + 1) // 2
                if window:
                    w_context += min(end, window)
                    w_pairs += window_pairs(start, end, window)
            for r in s.samplers:
                sampled[r.request_id] = SIM_TOKEN
        if window:
            return sampled, self.cost.step_time(tokens, context, pairs, w_context, w_pairs, num_seqs=len(out.seqs))
        return sampled, self.cost.step_time(tokens, context, pairs, num_seqs=len(out.seqs))


def percentiles(xs: list[float], prefix: str) -> dict:
    xs = sorted(xs)
    if not xs:
        return {f"{prefix}_{q}_s": None for q in ("p50", "p90", "p99", "mean")}
    pick = lambda q: xs[min(len(xs) - 1, int(q * len(xs)))]  # noqa: E731
    return {f"{prefix}_p50_s": pick(0.5), f"{prefix}_p90_s": pick(0.9), f"{prefix}_p99_s": pick(0.99),
            f"{prefix}_mean_s": sum(xs) / len(xs)}


class EngineSim:
    """One simulated engine: the real ``Scheduler`` and ``KVCacheManager`` on a clock of its
    own, fed requests by trace index (``admit``) and advanced one scheduler step at a time
    (``step``). ``Simulator`` drives one; ``kvos.sim.fleet.FleetSimulator`` drives several.

    Invariant: ``clock`` never decreases; a request admitted at time ``t`` is admitted while
    ``clock <= t`` or the engine is idle (then ``clock`` jumps to ``t``), so its first step
    starts no earlier than its arrival. ``first``/``done`` map request ids (the trace index as
    a string) to the simulated times of the first output token and of the end.
    """

    def __init__(self, trace: list[TraceRequest], config: SimConfig, cost: CostModel) -> None:
        self.trace = trace
        self.cfg = config
        self.executor = SimExecutor(cost)
        bs = config.block_size
        layout = config.layout
        spec = FullAttentionSpec(bs, 1, 1, 1) if layout is None else layout.groups[0].spec
        longest = max(r.input_len + r.output_len for r in self.trace)
        total = sum(math.ceil((r.input_len + r.output_len) / bs) for r in self.trace)
        if layout is None:
            unlimited = total + 1
        else:  # a group owns a new large page only when its owned ones are full: <= cdiv(total, per) + 1
            unlimited = sum(cdiv(total, layout.blocks_per_large_page(g)) + 1 for g in range(len(layout.groups))) + 1
        num_blocks = unlimited if config.num_blocks is None else config.num_blocks
        self._oracle: dict[bytes, deque[int]] | None = None
        if config.allocator == "contiguous":
            assert isinstance(spec, FullAttentionSpec)
            self.kv: KVCacheManager = ContiguousKVManager(spec, num_blocks, config.max_model_len or longest)
        elif layout is not None and len(layout.groups) > 1:  # one policy per group, by name
            self.kv = KVCacheManager(layout, num_blocks, SIM_MODEL_ID, config.enable_prefix_caching,
                                     config.eviction_policy)
        else:
            policy = make_policy(config.eviction_policy, self._next_use if config.eviction_policy == "belady" else None,
                                 capacity=num_blocks, block_size=bs)
            self.kv = KVCacheManager(layout or spec, num_blocks, SIM_MODEL_ID, config.enable_prefix_caching, policy)
            if isinstance(policy, BeladyPolicy):
                self._build_oracle()
        self.scheduler = Scheduler(config.scheduler_config(), self.kv)
        self.schedule_hook = None  # called with each SchedulerOutput (tests compare with the engine)
        self.tier: SimTier | None = None
        if config.tier is not None:
            self.tier = SimTier(config.tier, bs, cost.kv_bytes_per_token * bs)
            self.scheduler.lower_tier_lookup = self.tier.lookup
            self.tier.demand = self._waiting_hashes
            self.kv.pool.add_listener(self.tier)  # write-through or write-back (the single group's pool)
        self.cost = cost
        self.encoding_bytes = 0
        """An image's encoding in the pool's bytes (the abstract spec's scale for a model-less layout)."""
        if any(r.images for r in trace) and cost.encoding_bytes and config.engine.encoder_cache_mb > 0 \
                and config.allocator == "paged":
            scale = spec.bytes_per_token / cost.kv_bytes_per_token if layout is None else 1.0
            lay = self.kv.layout
            page = lay.large_page_bytes
            self.encoding_bytes = max(1, math.ceil(cost.encoding_bytes * scale))
            self.kv.attach_encoder(min(g.spec.page_bytes for g in lay.groups),
                                   max(1, int(config.engine.encoder_cache_mb * (1 << 20) * scale) // page))
        self.encoder_runs = 0
        self.encoder_seconds = 0.0
        self.capacity = self.kv.capacity_tokens(config.max_num_batched_tokens)
        self.clock = 0.0
        self.steps = 0
        self.busy_s = 0.0
        self.first: dict[str, float] = {}
        self.done: dict[str, float] = {}
        self.hit_blocks = self.total_blocks = self.hit_tokens = self.prompt_tokens = 0
        self.hit_blocks_of: dict[int, int] = {}  # trace index -> leading prompt blocks hit
        self.util_tokens = self.util_slots = 0
        self.by_bytes = config.layout is not None and config.allocator == "paged"
        self.waste_sum, self.waste_steps = 0.0, 0
        self.group_peak = [0] * self.kv.num_groups
        self.running_sum = self.running_peak = 0
        self.index_of: dict[str, int] = {}
        self.loads: list[tuple[float, int, Request, int]] = []  # (copy ends, arrival, request, blocks)
        self.tier_hit_tokens = 0
        self.bar = None  # a tqdm bar to advance per finished request

    def _waiting_hashes(self, n: int) -> Iterator[list[bytes]]:
        """The prompt blocks each of the next ``n`` waiting requests could hit, in queue order
        (as ``OffloadManager.publish_demand`` tells the engine's CPU tier)."""
        bs = self.cfg.block_size
        for r in self.scheduler.waiting_head(n):
            yield self.kv.block_hashes(r)[: (r.num_tokens - 1) // bs]

    # -- Belady's oracle: the requests (by arrival index) that will use each block hash ----
    def _build_oracle(self) -> None:
        root = root_hash(SIM_MODEL_ID, None)
        self._oracle = {}
        for i, r in enumerate(self.trace):
            hashes: list[bytes] = []
            extend_block_hashes(hashes, r.prompt_tokens(i), self.cfg.block_size, root)
            for h in hashes:
                self._oracle.setdefault(h, deque()).append(i)

    def _next_use(self, block_hash: bytes) -> float:
        uses = self._oracle.get(block_hash) if self._oracle is not None else None
        return uses[0] if uses else math.inf

    def _consume_uses(self, index: int, hashes: list[bytes]) -> None:
        assert self._oracle is not None
        policy = self.kv.pool.evictor
        for h in hashes:
            uses = self._oracle.get(h)
            while uses and uses[0] <= index:
                uses.popleft()
            block = self.kv.pool.index.get(h)
            if block is not None and block.ref_cnt == 0:
                policy.update(block)  # type: ignore[attr-defined]

    # -- driving it --------------------------------------------------------------------
    def accepts(self, index: int) -> bool:
        """Whether the engine takes trace request ``index`` (it rejects a prompt it can never hold)."""
        return self.trace[index].input_len + 1 <= self.capacity

    def admit(self, index: int, at: float | None = None) -> None:
        """Queue trace request ``index`` (``accepts`` must hold). ``at``: its arrival time; an
        idle engine's clock moves up to it."""
        r = self.trace[index]
        spans: tuple[tuple[int, int], ...] = ()
        if self.cfg.engine.segment_reuse and r.segments is not None:
            ends = list(itertools.accumulate(n for _, n in r.segments))
            spans = tuple((e - n, e) for (_, n), e in zip(r.segments, ends) if n)
        media = tuple(MediaItem(off, n, f"image-{img}") for off, n, img in r.images or ())
        req = Request(str(index), r.prompt_tokens(index),
                      SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True), segments=spans,
                      media=media)
        self.index_of[req.request_id] = index
        if at is not None and not self.scheduler.has_unfinished():
            self.clock = max(self.clock, at)
        self.scheduler.add_request(req)

    def busy(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self, next_arrival: float = math.inf) -> None:
        """One turn of the loop after the arrivals up to ``clock`` are admitted: finish the tier
        loads that have ended, then run one scheduler step and move the clock by its duration;
        with nothing to run, move the clock to the next load's end or ``next_arrival``."""
        cfg, sched, kv, loads = self.cfg, self.scheduler, self.kv, self.loads
        clock = self.clock
        while loads and loads[0][0] <= clock:  # tier loads whose copy has ended
            _, _, req, n = heapq.heappop(loads)
            sched.finish_loading(req, [CPU_SOURCE] * n)
        if not sched.has_unfinished():
            if next_arrival < math.inf:
                self.clock = max(clock, next_arrival)
            return
        out = sched.schedule()
        if self.schedule_hook is not None:
            self.schedule_hook(out)
        for load in out.loads:
            assert self.tier is not None
            n, end = self.tier.load(load.hashes, clock)
            heapq.heappush(loads, (end, load.request.arrival, load.request, n))
        if out.is_empty:
            if loads or next_arrival < math.inf:
                self.clock = max(clock, min(loads[0][0] if loads else math.inf, next_arrival))
                return
            raise RuntimeError("simulation stalled: the pool cannot hold the waiting requests")
        for s in out.seqs:
            req = s.request
            if req.prefill_only:  # a segment fill: the engine's own work, not a trace request
                continue
            if req.num_preemptions == 0 and req.request_id not in self.first \
                    and s.start < req.num_prompt_tokens and not getattr(req, "_counted", False):
                req._counted = True  # type: ignore[attr-defined]
                i = self.index_of[req.request_id]
                tr = self.trace[i]
                hb, tb = self._block_hits(req, tr)
                self.hit_blocks_of[i] = hb
                self.hit_blocks += hb
                self.total_blocks += tb
                self.hit_tokens += req.num_cached_tokens
                self.tier_hit_tokens += req.cached_by_source.get(CPU_SOURCE, 0)
                self.prompt_tokens += req.num_prompt_tokens
                if self._oracle is not None:
                    self._consume_uses(i, kv.block_hashes(req))
        sampled, dt = self.executor.execute(out)
        if any(s.request.media for s in out.seqs):
            dt += self._encode(out)
        clock += dt
        self.clock = clock
        self.busy_s += dt
        self.steps += 1
        self.running_sum += len(sched.running)
        self.running_peak = max(self.running_peak, len(sched.running))
        if self.by_bytes:  # live KV bytes (sliding layers: their window) over bytes held for running requests
            mem = kv.memory_breakdown()
            if mem["held_bytes"]:
                self.util_tokens += mem["live_bytes"]
                self.util_slots += mem["held_bytes"]
                self.waste_sum += mem["waste_fraction"]
                self.waste_steps += 1
            for g, u in enumerate(kv.group_usage()):
                self.group_peak[g] = max(self.group_peak[g], u.used)
        else:
            for req in sched.running:
                held = kv.num_held_blocks(req.request_id)
                if held:
                    self.util_tokens += req.num_computed_tokens
                    self.util_slots += held * cfg.block_size
        finished = sched.update_from_output(out, sampled)
        if self.tier is not None:
            self.tier.after_step()
        for req in finished:
            self.first.setdefault(req.request_id, clock)
            if req.is_finished:
                self.done[req.request_id] = clock
                if self.bar is not None:
                    self.bar.update(1)

    def _encode(self, out: SchedulerOutput) -> float:
        """The step's encoder work: its images not in the encoder cache (each once), as the
        engine plans them (``plan_encodings``); seconds at the cost model's rate."""
        media = [m for s in out.seqs for m in media_overlapping(s.request.media, s.start, s.start + s.num_new_tokens)]
        if self.kv.encoder is not None:
            runs = sum(not cached for cached, _ in plan_encodings(self.kv.encoder, media, self.encoding_bytes).values())
        else:
            runs = len({m.key for m in media})
        self.encoder_runs += runs
        self.encoder_seconds += runs * self.cost.encoder_s_per_image
        return runs * self.cost.encoder_s_per_image

    def _block_hits(self, req: Request, tr: TraceRequest) -> tuple[int, int]:
        """Leading prompt blocks the cache serves when the request is first scheduled (no
        last-token cap), over its blocks (a Mooncake trace at its own 512-token block size:
        over the trace's ``hash_ids``, whose trailing partial block the cache never holds)."""
        full_hit = self.kv.longest_hit_tokens(req, req.num_prompt_tokens) // self.cfg.block_size
        if tr.hash_ids is not None and self.cfg.block_size == MOONCAKE_BLOCK:
            return full_hit, len(tr.hash_ids)
        return full_hit, math.ceil(req.num_prompt_tokens / self.cfg.block_size)

class Simulator:
    """Replays a trace through one ``EngineSim``: arrivals are admitted when the engine's clock
    reaches them, before the step that starts then."""

    def __init__(self, trace: list[TraceRequest], config: SimConfig, cost: CostModel) -> None:
        if not trace:
            raise ValueError("trace: no requests")
        self.trace = sorted(trace, key=lambda r: r.arrival_s)
        self.cfg = config
        self.engine = EngineSim(self.trace, config, cost)
        self.executor = self.engine.executor
        self.kv = self.engine.kv
        self.scheduler = self.engine.scheduler
        self.tier = self.engine.tier
        self.schedule_hook = None  # called with each SchedulerOutput (tests compare with the engine)

    def run(self, progress: bool = False) -> dict:
        cfg, trace, eng = self.cfg, self.trace, self.engine
        eng.schedule_hook = self.schedule_hook
        t_wall = time.perf_counter()
        nxt = 0
        arrival = [r.arrival_s * cfg.time_scale for r in trace]
        rejected = 0
        eng.bar = bar = tqdm(total=len(trace), desc="simulating", unit="req", disable=not progress)
        while nxt < len(trace) or eng.busy():
            while nxt < len(trace) and arrival[nxt] <= eng.clock:
                if not eng.accepts(nxt):  # the engine rejects such a prompt too
                    rejected += 1
                else:
                    eng.admit(nxt)
                nxt += 1
            eng.step(arrival[nxt] if nxt < len(trace) else math.inf)
        bar.close()
        report = self._report(arrival, eng.first, eng.done, eng.clock, eng.steps, time.perf_counter() - t_wall,
                              eng.hit_blocks, eng.total_blocks, eng.hit_tokens, eng.prompt_tokens,
                              eng.util_tokens, eng.util_slots)
        report["rejected_requests"] = rejected
        if self.tier is not None:
            report.update(self.tier.report())
            report["tier_token_hit_rate"] = eng.tier_hit_tokens / eng.prompt_tokens if eng.prompt_tokens else 0.0
        if any(r.images for r in trace):
            enc = self.kv.encoder
            report.update({"encoder_runs": eng.encoder_runs, "encoder_seconds": eng.encoder_seconds,
                           "encoder_cache_hits": enc.hits if enc is not None else 0,
                           "encoder_cache_evictions": enc.evictions if enc is not None else 0})
        if cfg.engine.segment_reuse:
            c = self.kv.counters
            report.update({"segment_recompute": cfg.engine.segment_recompute, "segment_hits": c.segment_hits,
                           "segment_reused_tokens": c.segment_reused_tokens,
                           "segment_recomputed_tokens": c.segment_recomputed_tokens, "segment_fills": c.segment_fills,
                           "prefix_hit_tokens": c.prefix_hits_tokens})
        report["running_mean"] = eng.running_sum / eng.steps if eng.steps else 0.0
        report["running_peak"] = eng.running_peak
        if cfg.layout is not None:
            report["kv_layout"] = cfg.layout.mode
            report["page_bytes"] = cfg.layout.large_page_bytes
            report["kv_groups"] = [{k: (len(v) if k == "layers" else v) for k, v in d.items()}
                                   for d in cfg.layout.describe()]
        if eng.by_bytes:
            report["kv_waste_mean"] = eng.waste_sum / eng.waste_steps if eng.waste_steps else 0.0
            report["group_peak_blocks"] = eng.group_peak
        return report

    def _report(self, arrival, first, done, clock, steps, wall, hit_blocks, total_blocks, hit_tokens,
                prompt_tokens, util_tokens, util_slots) -> dict:
        idx = {str(i): a for i, a in enumerate(arrival)}
        ttft = [first[r] - idx[r] for r in first]
        e2e = [done[r] - idx[r] for r in done]
        out_tokens = sum(r.output_len for r in self.trace)
        tpot = [(done[r] - first[r]) / (self.trace[int(r)].output_len - 1) for r in done
                if self.trace[int(r)].output_len > 1]
        makespan = clock - arrival[0]
        c = self.kv.counters
        cfg = self.cfg
        return {
            "num_requests": len(self.trace), "block_size": cfg.block_size,
            "num_blocks": "unlimited" if cfg.num_blocks is None else cfg.num_blocks,
            "allocator": cfg.allocator, "eviction_policy": cfg.eviction_policy,
            "scheduling_policy": cfg.scheduling_policy, "eviction_lookahead": cfg.eviction_lookahead,
            "block_hit_rate": hit_blocks / total_blocks if total_blocks else 0.0,
            "token_hit_rate": hit_tokens / prompt_tokens if prompt_tokens else 0.0,
            **percentiles(ttft, "ttft"), **percentiles(tpot, "tpot"), **percentiles(e2e, "e2e"),
            "throughput_tok_s": out_tokens / makespan if makespan > 0 else 0.0,
            "total_tok_s": (out_tokens + sum(r.input_len for r in self.trace)) / makespan if makespan > 0 else 0.0,
            "kv_utilization": util_tokens / util_slots if util_slots else 0.0,
            "preemptions": c.preemptions, "evictions": c.evictions, "recomputed_tokens": c.recomputed_tokens,
            "makespan_s": makespan, "steps": steps, "sim_wall_s": wall, "ttft_s": ttft,
        }
