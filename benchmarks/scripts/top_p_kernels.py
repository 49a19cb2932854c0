"""Time the sampler's top-p pieces at decode size on a GPU (256 rows x 128,256 tokens, bf16
logits): the race path (``top_p_sample``: threshold on logits + race), its two kernels alone, the
earlier path (float32 softmax, threshold on probabilities, mask, Exp noise, divide, argmax) and
greedy's argmax; then sweep the kernels' settings. With ``--then ARGS...``, set the fastest
settings and run ``kvos ARGS`` in this process (e.g. ``bench sampling ...``).

``python benchmarks/scripts/top_p_kernels.py [--then bench sampling ...]``"""
from __future__ import annotations

import json
import sys

import torch
from triton.testing import do_bench

from kvos.kernels import top_p as K

then = sys.argv[sys.argv.index("--then") + 1:] if "--then" in sys.argv else None
R, V = 256, 128256
dev = torch.device("cuda")
torch.manual_seed(0)
x = (torch.randn(R, V, device=dev) * 2).bfloat16()
temp = torch.full((R,), 0.8, device=dev)
p = torch.full((R,), 0.95, device=dev)
mp = torch.zeros(R, device=dev)
seeds = torch.randint(0, 1 << 62, (R,), device=dev)
inv_t = 1 / temp
cut, m = K.logit_threshold(x, inv_t, p)
out = {}


def old_path():
    probs = (x.float() / temp[:, None]).softmax(dim=-1)
    tau = K.top_p_threshold(probs, p)
    probs = probs.masked_fill(probs < tau[:, None], 0.0)
    return (probs / torch.empty_like(probs).exponential_()).argmax(dim=-1)


def bench(fn):
    try:
        return do_bench(fn)
    except Exception:  # e.g. out of resources
        return float("inf")


out["greedy_argmax_ms"] = do_bench(lambda: x.argmax(dim=-1))
out["old_path_ms"] = do_bench(old_path)
out["race_path_ms"] = do_bench(lambda: K.top_p_sample(x, temp, p, mp, seeds))
out["logit_threshold_ms"] = do_bench(lambda: K.logit_threshold(x, inv_t, p))
res = torch.empty(R, dtype=torch.long, device=dev)
c2, m2 = torch.empty_like(cut), torch.empty_like(m)
scratch = torch.empty(R, K.CAP, device=dev)
tiles = {}
for nc, block, warps in ((8, 4096, 16), (8, 2048, 8), (4, 4096, 8), (8, 2048, 16), (16, 2048, 16)):
    for full in (1, 2, 3, 4):
        def run():
            K._threshold_kernel[(R,)](x, inv_t, p, c2, m2, scratch, V, V, BLOCK=block, NC=nc, LOGITS=True,
                                      FULL_PASSES=full, CAP=K.CAP, num_warps=warps)
        t = bench(run)
        tiles[(nc, block, warps, full)] = (t, bool(torch.equal(c2, cut)))
race = {}
for block in (1024, 2048, 4096):
    for warps in (4, 8, 16):
        race[(block, warps)] = bench(lambda: K._race_kernel[(R,)](
            x, inv_t, m, cut, seeds, res, R, V, V, ROWS=1, BLOCK=block, num_warps=warps))
best_t = min(tiles, key=lambda k: tiles[k][0])
best_r = min(race, key=race.get)
out["threshold_sweep_ms"] = {str(k): v for k, v in sorted(tiles.items(), key=lambda kv: kv[1][0])}
out["race_sweep_ms"] = {str(k): v for k, v in sorted(race.items(), key=lambda kv: kv[1])}
out["threshold_best"], out["race_best"] = str(best_t), str(best_r)
K.CANDIDATES, K._BLOCK, K._NUM_WARPS, K.FULL_PASSES = best_t
K.RACE_BLOCK, K.RACE_WARPS = best_r
out["tuned_race_path_ms"] = do_bench(lambda: K.top_p_sample(x, temp, p, mp, seeds))
out["tuned_logit_threshold_ms"] = do_bench(lambda: K.logit_threshold(x, inv_t, p))
out["device"] = torch.cuda.get_device_name()
print(json.dumps(out, indent=1), flush=True)
if then:
    from kvos.cli import main

    sys.exit(main(then))
