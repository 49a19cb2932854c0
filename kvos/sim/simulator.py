"""Replays a workload through the engine's own Scheduler and KV memory system, with a cost model
in place of the model (the SimExecutor)."""
from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass

from tqdm.auto import tqdm

from kvos.cache.eviction import BeladyPolicy, make_policy
from kvos.cache.hashing import extend_block_hashes, root_hash
from kvos.cache.kv_manager import KVCacheManager
from kvos.cache.spec import FullAttentionSpec
from kvos.engine.request import Request
from kvos.engine.sampling_params import SamplingParams
from kvos.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from kvos.sim.contiguous import ContiguousKVManager
from kvos.sim.cost_model import CostModel
from kvos.sim.traces import MOONCAKE_BLOCK, TraceRequest

SIM_MODEL_ID = "sim"
SIM_TOKEN = -7  # every simulated output token


@dataclass
class SimConfig:
    block_size: int = 16
    num_blocks: int | None = None  # None: unlimited (every request's blocks fit at once)
    eviction_policy: str = "lru"
    scheduling_policy: str = "fcfs"
    allocator: str = "paged"  # or "contiguous"
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    max_model_len: int | None = None  # contiguous reservation (default: the trace's longest)
    time_scale: float = 1.0
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.allocator not in ("paged", "contiguous"):
            raise ValueError(f"allocator must be 'paged' or 'contiguous', got {self.allocator!r}")
        if self.time_scale <= 0:
            raise ValueError(f"time_scale must be > 0, got {self.time_scale}")


class SimExecutor:
    """Stands in for the model runner: a step's duration from the cost model, one synthetic
    token per sampled sequence."""

    def __init__(self, cost: CostModel) -> None:
        self.cost = cost

    def execute(self, out: SchedulerOutput) -> tuple[dict[str, int], float]:
        tokens = context = pairs = 0
        sampled: dict[str, int] = {}
        for s in out.seqs:
            end = s.start + s.num_new_tokens
            tokens += s.num_new_tokens
            context += end
            pairs += s.num_new_tokens * (s.start + end + 1) // 2
            for r in s.samplers:
                sampled[r.request_id] = SIM_TOKEN
        return sampled, self.cost.step_time(tokens, context, pairs)


def percentiles(xs: list[float], prefix: str) -> dict:
    xs = sorted(xs)
    if not xs:
        return {f"{prefix}_{q}_s": None for q in ("p50", "p90", "p99", "mean")}
    pick = lambda q: xs[min(len(xs) - 1, int(q * len(xs)))]  # noqa: E731
    return {f"{prefix}_p50_s": pick(0.5), f"{prefix}_p90_s": pick(0.9), f"{prefix}_p99_s": pick(0.99),
            f"{prefix}_mean_s": sum(xs) / len(xs)}


class Simulator:
    def __init__(self, trace: list[TraceRequest], config: SimConfig, cost: CostModel) -> None:
        if not trace:
            raise ValueError("trace: no requests")
        self.trace = sorted(trace, key=lambda r: r.arrival_s)
        self.cfg = config
        self.executor = SimExecutor(cost)
        bs = config.block_size
        spec = FullAttentionSpec(bs, 1, 1, 1)
        longest = max(r.input_len + r.output_len for r in self.trace)
        unlimited = sum(math.ceil((r.input_len + r.output_len) / bs) for r in self.trace) + 1
        num_blocks = unlimited if config.num_blocks is None else config.num_blocks
        self._oracle: dict[bytes, deque[int]] | None = None
        if config.allocator == "contiguous":
            self.kv: KVCacheManager = ContiguousKVManager(spec, num_blocks, config.max_model_len or longest)
        else:
            policy = make_policy(config.eviction_policy, self._next_use if config.eviction_policy == "belady" else None)
            self.kv = KVCacheManager(spec, num_blocks, SIM_MODEL_ID, config.enable_prefix_caching, policy)
            if isinstance(policy, BeladyPolicy):
                self._build_oracle()
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_batched_tokens, config.max_num_seqs,
                                                   config.scheduling_policy), self.kv)
        self.schedule_hook = None  # called with each SchedulerOutput (tests compare with the engine)

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

    # -- the loop ----------------------------------------------------------------------
    def run(self, progress: bool = False) -> dict:
        cfg, trace, sched, kv = self.cfg, self.trace, self.scheduler, self.kv
        t_wall = time.perf_counter()
        clock, nxt, steps = 0.0, 0, 0
        arrival = [r.arrival_s * cfg.time_scale for r in trace]
        first: dict[str, float] = {}
        done: dict[str, float] = {}
        hit_blocks = total_blocks = hit_tokens = prompt_tokens = 0
        seen_trace_ids: set[int] = set()
        util_tokens = util_slots = 0
        index_of: dict[str, int] = {}
        capacity = kv.pool.num_usable_blocks * cfg.block_size
        rejected = 0
        bar = tqdm(total=len(trace), desc="simulating", unit="req", disable=not progress)
        while nxt < len(trace) or sched.has_unfinished():
            while nxt < len(trace) and arrival[nxt] <= clock:
                r = trace[nxt]
                if r.input_len + 1 > capacity:  # the engine rejects such a prompt too
                    rejected += 1
                    nxt += 1
                    continue
                req = Request(str(nxt), r.prompt_tokens(nxt),
                              SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True))
                index_of[req.request_id] = nxt
                sched.add_request(req)
                nxt += 1
            if not sched.has_unfinished():
                if nxt < len(trace):
                    clock = max(clock, arrival[nxt])
                continue
            out = sched.schedule()
            if self.schedule_hook is not None:
                self.schedule_hook(out)
            if out.is_empty:
                if nxt < len(trace):
                    clock = max(clock, arrival[nxt])
                    continue
                raise RuntimeError("simulation stalled: the pool cannot hold the waiting requests")
            for s in out.seqs:
                req = s.request
                if req.num_preemptions == 0 and s.start == req.num_cached_tokens and req.request_id not in first \
                        and s.start < req.num_prompt_tokens and not getattr(req, "_counted", False):
                    req._counted = True  # type: ignore[attr-defined]
                    i = index_of[req.request_id]
                    tr = trace[i]
                    hb, tb = self._block_hits(req, tr, seen_trace_ids)
                    hit_blocks += hb
                    total_blocks += tb
                    hit_tokens += req.num_cached_tokens
                    prompt_tokens += req.num_prompt_tokens
                    if self._oracle is not None:
                        self._consume_uses(i, kv.group.block_hashes(req))
            sampled, dt = self.executor.execute(out)
            clock += dt
            steps += 1
            for req in sched.running:
                table = kv.group.tables.get(req.request_id)
                if table:
                    util_tokens += req.num_computed_tokens
                    util_slots += len(table) * cfg.block_size
            for req in sched.update_from_output(out, sampled):
                first.setdefault(req.request_id, clock)
                if req.is_finished:
                    done[req.request_id] = clock
                    bar.update(1)
        bar.close()
        report = self._report(arrival, first, done, clock, steps, time.perf_counter() - t_wall,
                              hit_blocks, total_blocks, hit_tokens, prompt_tokens, util_tokens, util_slots)
        report["rejected_requests"] = rejected
        return report

    def _block_hits(self, req: Request, tr: TraceRequest, seen: set[int]) -> tuple[int, int]:
        """Leading prompt blocks resident when the request is first scheduled (no last-token
        cap). With a Mooncake trace at its own 512-token block size, counted over the trace's
        blocks, a trailing partial block counting as hit when its id was computed before."""
        full_hit = len(self.kv.group.find_longest_hit(req, req.num_prompt_tokens)) if self.kv.enable_caching else 0
        if tr.hash_ids is not None and self.cfg.block_size == MOONCAKE_BLOCK:
            n_full = tr.input_len // MOONCAKE_BLOCK
            hits = full_hit
            if hits == n_full and len(tr.hash_ids) > n_full and tr.hash_ids[n_full] in seen:
                hits += 1
            seen.update(tr.hash_ids)
            return hits, len(tr.hash_ids)
        return full_hit, math.ceil(req.num_prompt_tokens / self.cfg.block_size)

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
            "scheduling_policy": cfg.scheduling_policy,
            "block_hit_rate": hit_blocks / total_blocks if total_blocks else 0.0,
            "token_hit_rate": hit_tokens / prompt_tokens if prompt_tokens else 0.0,
            **percentiles(ttft, "ttft"), **percentiles(tpot, "tpot"), **percentiles(e2e, "e2e"),
            "throughput_tok_s": out_tokens / makespan if makespan > 0 else 0.0,
            "total_tok_s": (out_tokens + sum(r.input_len for r in self.trace)) / makespan if makespan > 0 else 0.0,
            "kv_utilization": util_tokens / util_slots if util_slots else 0.0,
            "preemptions": c.preemptions, "evictions": c.evictions, "recomputed_tokens": c.recomputed_tokens,
            "makespan_s": makespan, "steps": steps, "sim_wall_s": wall, "ttft_s": ttft,
        }
