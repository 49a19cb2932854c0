"""Replays a trace across several simulated engines behind a router: each engine is an
``EngineSim`` (the real scheduler and KV memory system with a clock of its own), the router is
one of ``kvos.router``'s policies, unchanged.

Event-driven in simulated time. The next thing to happen is either the next arrival or the step
of the engine whose clock is earliest; an arrival goes first on a tie (as ``Simulator`` admits
arrivals before the step that starts at their time). An arrival at ``t`` is routed with the
router's view at ``t``: every engine's KV event batches are drained after each of its steps and
handed to the router at once, and loads are read from the engines' live state. Since a step is
applied when it starts, that view runs at most one step (of the engine concerned) ahead of
``t``, as a real router hears of a step's blocks when the step ends. With one engine the replay
is exactly ``Simulator``'s.
"""
from __future__ import annotations

import heapq
import math
import time

from tqdm.auto import tqdm

from kvos.cache.hashing import extend_block_hashes, root_hash
from kvos.router.config import RouterConfig
from kvos.router.policies import Router
from kvos.sim.cost_model import CostModel
from kvos.sim.simulator import SIM_MODEL_ID, EngineSim, SimConfig, percentiles
from kvos.sim.traces import TraceRequest


def imbalance(xs: list[float]) -> float:
    """``max / mean`` (1.0: perfectly even; ``len(xs)``: everything on one engine)."""
    mean = sum(xs) / len(xs) if xs else 0.0
    return max(xs) / mean if mean > 0 else 1.0


class FleetSimulator:
    """``num_engines`` engines of ``config`` each (pool sizes are per engine) behind ``router``
    (a ``Router``; a ``RouterConfig``; or a name from ``kvos.router.ROUTERS`` with the default
    settings); approx remembers ``approx_capacity`` blocks per engine (default: the engine's pool
    size), and the shared-prefix guard counts that many per engine.

    Invariant: each accepted request is admitted to exactly one engine, at its arrival time.
    """

    def __init__(self, trace: list[TraceRequest], config: SimConfig, cost: CostModel, num_engines: int,
                 router: Router | RouterConfig | str = "kv_aware", approx_capacity: int | None = None) -> None:
        if not trace:
            raise ValueError("trace: no requests")
        if num_engines < 1:
            raise ValueError(f"num_engines must be >= 1, got {num_engines}")
        if config.eviction_policy == "belady":
            raise ValueError("eviction_policy 'belady' reads each engine's future requests, which depend on the "
                             "router: not available with several engines")
        self.trace = sorted(trace, key=lambda r: r.arrival_s)
        self.cfg = config
        self.engines = [EngineSim(self.trace, config, cost) for _ in range(num_engines)]
        if isinstance(router, str):
            router = RouterConfig(router)
        if isinstance(router, RouterConfig):
            capacity = approx_capacity or config.num_blocks or self.engines[0].kv.pool.num_blocks
            router = router.build(num_engines, config.block_size, capacity)
        if router.num_engines != num_engines:
            raise ValueError(f"router: built for {router.num_engines} engines, the fleet has {num_engines}")
        if router.block_size != config.block_size:
            raise ValueError(f"router: block_size {router.block_size} differs from the engines' {config.block_size}")
        self.router = router
        if router.uses_events:
            for e, eng in enumerate(self.engines):
                eng.kv.enable_events(f"engine-{e}")

    def _publish(self, e: int) -> None:
        """Hand engine ``e``'s events since its last step to the router (a snapshot on a gap)."""
        kv = self.engines[e].kv
        batch = kv.events.drain() if kv.events is not None else None
        if batch is not None and not self.router.on_events(e, batch):
            self.router.on_snapshot(e, kv.event_snapshot())

    def run(self, progress: bool = False) -> dict:
        cfg, trace, engines, router = self.cfg, self.trace, self.engines, self.router
        t_wall = time.perf_counter()
        arrival = [r.arrival_s * cfg.time_scale for r in trace]
        root = root_hash(SIM_MODEL_ID, None)  # the trace's requests carry no cache salt
        engine_of = [-1] * len(trace)
        predicted = [0] * len(trace)
        version = [0] * len(engines)
        heap: list[tuple[float, int, int]] = []  # (clock, engine, version) of busy engines
        bar = tqdm(total=len(trace), desc=f"simulating {len(engines)} engines", unit="req", disable=not progress)
        for eng in engines:
            eng.bar = bar
        rejected = nxt = 0
        while True:
            while heap and heap[0][2] != version[heap[0][1]]:
                heapq.heappop(heap)
            t_next = arrival[nxt] if nxt < len(trace) else math.inf
            if nxt < len(trace) and (not heap or t_next <= heap[0][0]):
                i, nxt = nxt, nxt + 1
                if not engines[0].accepts(i):
                    rejected += 1
                    bar.update(1)
                    continue
                hashes: list[bytes] = []
                extend_block_hashes(hashes, trace[i].prompt_tokens(i), cfg.block_size, root)
                loads = [eng.scheduler.load() for eng in engines] if router.needs_loads else []
                e = router.choose(hashes, loads)
                predicted[i] = router.predicted_hits(e, hashes)
                router.on_routed(e, hashes)
                engines[e].admit(i, at=t_next)
                engine_of[i] = e
            elif heap:
                _, e, _ = heapq.heappop(heap)
                engines[e].step(t_next)
                if router.uses_events:
                    self._publish(e)
            else:
                break
            if engines[e].busy():
                version[e] += 1
                heapq.heappush(heap, (engines[e].clock, e, version[e]))
        bar.close()
        return self._report(arrival, engine_of, predicted, rejected, time.perf_counter() - t_wall)

    def _report(self, arrival: list[float], engine_of: list[int], predicted: list[int], rejected: int,
                wall: float) -> dict:
        cfg, trace, engines = self.cfg, self.trace, self.engines
        ttft, e2e, tpot = [], [], []
        for eng in engines:
            ttft += [t - arrival[int(r)] for r, t in eng.first.items()]
            for r, t in eng.done.items():
                i = int(r)
                e2e.append(t - arrival[i])
                if trace[i].output_len > 1:
                    tpot.append((t - eng.first[r]) / (trace[i].output_len - 1))
        n = len(engines)
        requests = [0] * n
        prompt = [0] * n
        for i, e in enumerate(engine_of):
            if e >= 0:
                requests[e] += 1
                prompt[e] += trace[i].input_len
        busy = [eng.busy_s for eng in engines]
        hit_blocks = sum(eng.hit_blocks for eng in engines)
        total_blocks = sum(eng.total_blocks for eng in engines)
        hit_tokens = sum(eng.hit_tokens for eng in engines)
        prompt_tokens = sum(eng.prompt_tokens for eng in engines)
        obtained = {i: hb for eng in engines for i, hb in eng.hit_blocks_of.items()}
        pred = sum(predicted[i] for i in obtained)
        got = sum(obtained.values())
        makespan = max(eng.clock for eng in engines) - arrival[0]
        out_tokens = sum(r.output_len for i, r in enumerate(trace) if engine_of[i] >= 0)
        counters = [eng.kv.counters for eng in engines]
        return {
            "num_requests": len(trace), "num_engines": n, "router": self.router.name,
            "overlap_weight": getattr(self.router, "overlap_weight", None),
            "balance": ([self.router.balance_abs, self.router.balance_rel] if hasattr(self.router, "balance_rel")
                        else None),
            "shared_balance": (list(self.router.shared_balance) if hasattr(self.router, "shared_balance") else None),
            "shared_threshold": getattr(self.router, "shared_threshold", None),
            "sole_margin": getattr(self.router, "sole_margin", None),
            "block_size": cfg.block_size, "num_blocks_per_engine": "unlimited" if cfg.num_blocks is None
            else cfg.num_blocks, "eviction_policy": cfg.eviction_policy, "scheduling_policy": cfg.scheduling_policy,
            "time_scale": cfg.time_scale,
            "block_hit_rate": hit_blocks / total_blocks if total_blocks else 0.0,
            "token_hit_rate": hit_tokens / prompt_tokens if prompt_tokens else 0.0,
            **percentiles(ttft, "ttft"), **percentiles(tpot, "tpot"), **percentiles(e2e, "e2e"),
            "throughput_tok_s": out_tokens / makespan if makespan > 0 else 0.0,
            "requests_per_engine": requests, "prompt_tokens_per_engine": prompt,
            "busy_s_per_engine": busy,
            "imbalance_requests": imbalance(requests), "imbalance_prompt_tokens": imbalance(prompt),
            "imbalance_busy": imbalance(busy),
            "predicted_hit_blocks": pred, "obtained_hit_blocks": got,
            "prediction_exact": (sum(predicted[i] == hb for i, hb in obtained.items()) / len(obtained)
                                 if obtained else 0.0),
            "rejected_requests": rejected,
            "preemptions": sum(c.preemptions for c in counters), "evictions": sum(c.evictions for c in counters),
            "recomputed_tokens": sum(c.recomputed_tokens for c in counters),
            "makespan_s": makespan, "steps": sum(eng.steps for eng in engines), "sim_wall_s": wall, "ttft_s": ttft,
        }
