"""Time the sampler's full-vocabulary kernel at decode size on a GPU (256 rows x 128,256 tokens,
bf16 logits): ``nucleus_sample`` (rejection sampling of top-p and min-p) on flat and peaked
rows, against greedy's argmax (results/top-p-nucleus-h100.json also holds the earlier
two-kernel path's times, measured before it was removed); then sweep its tile. With ``--then ARGS...``, set the fastest tile
and run ``kvos ARGS`` in this process (e.g. ``bench sampling ...``).

``python benchmarks/scripts/top_p_kernels.py [--output F] [--then bench sampling ...]``"""
from __future__ import annotations

import json
import sys

import torch
from triton.testing import do_bench

from kvos.kernels import top_p as K

then = sys.argv[sys.argv.index("--then") + 1:] if "--then" in sys.argv else None
output = sys.argv[sys.argv.index("--output") + 1] if "--output" in sys.argv else None
R, V = 256, 128256
dev = torch.device("cuda")
torch.manual_seed(0)
seeds = torch.randint(0, 1 << 62, (R,), device=dev)


def full(v: float) -> torch.Tensor:
    return torch.full((R,), v, device=dev)


# logits scale, temperature, top_p, min_p: random-weight models give near-flat rows (scale 2);
# trained models' rows are peaked (scale 8 puts most of the mass on a few tokens)
CASES = {"flat_t0.8_p0.95": (2.0, 0.8, 0.95, 0.0), "peaked_t0.8_p0.95": (8.0, 0.8, 0.95, 0.0),
         "flat_t0.8_p0.5": (2.0, 0.8, 0.5, 0.0), "flat_t1_min_p0.05": (2.0, 1.0, 1.0, 0.05),
         "flat_t0.8_only": (2.0, 0.8, 1.0, 0.0)}
out: dict = {"device": torch.cuda.get_device_name(), "rows": R, "vocab": V}
x = (torch.randn(R, V, device=dev) * 2).bfloat16()
out["greedy_argmax_ms"] = do_bench(lambda: x.argmax(dim=-1))
for name, (scale, t, p, mp) in CASES.items():
    x = (torch.randn(R, V, device=dev) * scale).bfloat16()
    args = (x, full(t), full(p), full(mp), seeds)
    out[f"nucleus_{name}_ms"] = do_bench(lambda: K.nucleus_sample(*args))
x = (torch.randn(R, V, device=dev) * 2).bfloat16()
args = (x, full(0.8), full(0.95), full(0.0), seeds)
sweep = {}
for block in (1024, 2048, 4096, 8192):
    for warps in (4, 8, 16, 32):
        try:
            sweep[(block, warps)] = do_bench(lambda: K.nucleus_sample(*args, block=block, num_warps=warps))
        except Exception:  # e.g. out of resources
            pass
best = min(sweep, key=sweep.get)
out["nucleus_sweep_ms"] = {str(k): v for k, v in sorted(sweep.items(), key=lambda kv: kv[1])}
out["nucleus_best"] = str(best)
K.NUCLEUS_BLOCK, K.NUCLEUS_WARPS = best
print(json.dumps(out, indent=1), flush=True)
if output:
    with open(output, "w") as f:
        json.dump(out, f, indent=1)
if then:
    from kvos.cli import main

    sys.exit(main(then))
