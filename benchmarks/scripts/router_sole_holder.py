"""kv_aware's sole-holder rule (#44; ``KVAware.sole_margin``, the default since 2026-12-01) on
and off: when one engine holds at least ``MARGIN`` more of the request's leading blocks than
every other and both balance guards allow it, it is chosen whatever its queue (the request's own
history lives there); otherwise the router's cost as usual. Replays 8 simulated engines of 64
sequences (912 blocks of 512 each, 2,048 batched tokens, the time scales ``kvos bench routing
--engines 8 --max-num-seqs 64`` computes) against the rule off, and the hot-prompt case of
``tests/sim/test_fleet_sim.py`` (two engines). Prints one line per run: margin, trace, requests,
block hit rate and its ratio to one engine with all the memory, p90 TTFT, and the requests /
blocks routed away from the engine with the longest predicted prefix.

    python benchmarks/scripts/router_sole_holder.py [conversation:3000 synthetic:3000 conversation:0 synthetic:0 hot]
    W=60 MARGIN=4 python ...    # another kv weight (figures move by up to +-0.04 between neighbours), margin
"""
import os
import sys

from kvos.router.policies import KVAware
from kvos.sim.cost_model import CostModel
from kvos.sim.fleet import FleetSimulator
from kvos.sim.hardware import GPUS
from kvos.sim.shapes import PRESETS
from kvos.sim.simulator import SimConfig
from kvos.sim.traces import TraceRequest, load_mooncake

COST = CostModel.for_model(PRESETS["llama-3.1-8b"], GPUS["H100-80G"])
PATHS = {"conversation": "tests/data/mooncake_conversation.jsonl.gz", "synthetic": "tests/data/mooncake_synthetic.jsonl.gz"}
SCALES = {("conversation", 3000): 0.25345338810732, ("synthetic", 3000): 0.18631340379489164,
          ("conversation", 0): 0.28363563217094656, ("synthetic", 0): 0.18976433492294315}
ONE_ENGINE = {("conversation", 3000): 0.17010878328929904, ("synthetic", 3000): 0.20259206226823806,
              ("conversation", 0): 0.16960831889081457, ("synthetic", 0): 0.3598546075141331}
MARGIN = int(os.environ.get("MARGIN", 2))


class Counted(KVAware):
    """kv_aware counting requests and blocks routed away from the longest predicted prefix."""

    away = (0, 0)

    def choose(self, hashes, loads):
        e = super().choose(hashes, loads)
        hits = [self.predicted_hits(x, hashes) for x in range(self.num_engines)]
        if max(hits) > hits[e]:
            self.away = (self.away[0] + 1, self.away[1] + max(hits) - hits[e])
        return e


def run(margin: int, spec: str) -> str:
    weight = float(os.environ.get("W", 64))
    if spec == "hot":
        firsts = [TraceRequest(t, 416, 64, segments=[(i, 384), (1000 + i, 32)]) for i, t in enumerate([0, 1.0, 1.2, 1.25])]
        rest = [TraceRequest(2.5 + 0.02 * k, 416, 64, segments=[(k % 4, 384), (2000 + k, 32)]) for k in range(400)]
        cfg = SimConfig.of(block_size=16, num_blocks=None, max_num_batched_tokens=8192, max_num_seqs=256)
        out = FleetSimulator(firsts + rest, cfg, COST, 2, Counted(2, 16, weight, sole_margin=margin)).run()
        return f"margin {margin} hot prompts: requests per engine {out['requests_per_engine']}"
    name, limit = spec.split(":")
    key = (name, int(limit))
    cfg = SimConfig.of(block_size=512, num_blocks=912, time_scale=SCALES[key], max_num_seqs=64, max_num_batched_tokens=2048)
    router = Counted(8, 512, weight, capacity_blocks=912, sole_margin=margin)
    out = FleetSimulator(load_mooncake(PATHS[name], key[1] or None), cfg, COST, 8, router).run()
    hit = out["block_hit_rate"]
    return (f"margin {margin} {name} {limit or 'whole'}: block hit {hit:.4f} "
            f"({hit / ONE_ENGINE[key]:.3f} of one engine), "
            f"p90 TTFT {out['ttft_p90_s']:.2f} s, routed away {router.away[0]} requests / {router.away[1]} blocks")


if __name__ == "__main__":
    for spec in sys.argv[1:] or ["conversation:3000", "synthetic:3000", "hot"]:
        for margin in (0, MARGIN):
            print(run(margin, spec), flush=True)
