"""A prototype balance guard for kv_aware (#44), not in the router: the configured guard is loose
(16,3), and the tight one (8,2) leaves an engine out only when the request's prefix there is
shared, i.e. its last cached block was in more than ``T`` earlier requests (a hot system prompt,
cheap to copy to another engine), never when it is the request's own conversation. Replays 8
simulated engines of 64 sequences on the first 3,000 requests of each Mooncake trace (the
time scales ``kvos bench routing --limit 3000 --engines 8 --max-num-seqs 64`` computes) and the
hot-prompt case of ``tests/sim/test_fleet_sim.py`` (two engines; the current guard spreads it
207 / 197). Prints one line per run: trace, T, block hit rate, p90 TTFT.

    python benchmarks/scripts/router_shared_prefix_guard.py [T ...]
"""
import sys
from multiprocessing import Pool

from kvos.router.policies import KVAware
from kvos.sim.cost_model import CostModel
from kvos.sim.fleet import FleetSimulator
from kvos.sim.hardware import GPUS
from kvos.sim.shapes import PRESETS
from kvos.sim.simulator import SimConfig
from kvos.sim.traces import TraceRequest, load_mooncake

COST = CostModel.for_model(PRESETS["llama-3.1-8b"], GPUS["H100-80G"])
TRACES = {"conversation": ("tests/data/mooncake_conversation.jsonl.gz", 0.25345338810732),
          "synthetic": ("tests/data/mooncake_synthetic.jsonl.gz", 0.18631340379489164)}
REFERENCE = {"conversation": 0.1701, "synthetic": 0.2026}  # one engine with 8 x 912 blocks


class SharedPrefixGuard(KVAware):
    """kv_aware with the loose guard of its settings, plus the tight guard (8,2) for requests
    whose cached prefix on the loaded engine is shared by more than ``threshold`` requests."""

    def __init__(self, *a, threshold: int = 8, **k) -> None:
        super().__init__(*a, **k)
        self.threshold = threshold
        self.uses: dict[bytes, int] = {}

    def choose(self, hashes, loads):
        live = self._live()
        loose = self.balanced(live, loads)
        saved = self.balance_abs, self.balance_rel
        self.balance_abs, self.balance_rel = 8, 2.0
        tight = set(self.balanced(live, loads))
        self.balance_abs, self.balance_rel = saved
        allowed = [e for e in loose if e in tight or not (h := self.predicted_hits(e, hashes))
                   or self.uses.get(hashes[h - 1], 0) <= self.threshold] or loose
        bs = self.block_size
        return min(allowed, key=lambda e: (self.cost(e, hashes, loads[e]), loads[e].blocks(bs), self.routed[e], e))

    def on_routed(self, engine, hashes):
        super().on_routed(engine, hashes)
        for h in hashes:
            self.uses[h] = self.uses.get(h, 0) + 1


def router(engines: int, block_size: int, threshold: int) -> SharedPrefixGuard:
    return SharedPrefixGuard(engines, block_size, queue_weight=0.1, balance_abs=16, balance_rel=3.0,
                             threshold=threshold)


def trace_run(args):
    name, threshold = args
    path, scale = TRACES[name]
    cfg = SimConfig.of(block_size=512, num_blocks=912, time_scale=scale, max_num_seqs=64, max_num_batched_tokens=2048)
    out = FleetSimulator(load_mooncake(path, 3000), cfg, COST, 8, router(8, 512, threshold)).run()
    return (f"{name} T={threshold}: block hit {out['block_hit_rate']:.4f} "
            f"({out['block_hit_rate'] / REFERENCE[name]:.3f} of one engine), p90 TTFT {out['ttft_p90_s']:.2f} s")


def hot_prompts(threshold: int) -> str:
    firsts = [TraceRequest(t, 416, 64, segments=[(i, 384), (1000 + i, 32)]) for i, t in enumerate([0, 1.0, 1.2, 1.25])]
    rest = [TraceRequest(2.5 + 0.02 * k, 416, 64, segments=[(k % 4, 384), (2000 + k, 32)]) for k in range(400)]
    cfg = SimConfig.of(block_size=16, num_blocks=None, max_num_batched_tokens=8192, max_num_seqs=256)
    out = FleetSimulator(firsts + rest, cfg, COST, 2, router(2, 16, threshold)).run()
    return f"hot prompts T={threshold}: requests per engine {out['requests_per_engine']}"


if __name__ == "__main__":
    thresholds = [int(t) for t in sys.argv[1:]] or [4, 8, 16]
    with Pool(2) as pool:
        for line in pool.imap(trace_run, [(n, t) for t in thresholds for n in TRACES]):
            print(line, flush=True)
    for t in thresholds:
        print(hot_prompts(t), flush=True)
