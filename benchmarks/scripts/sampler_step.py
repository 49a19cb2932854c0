"""The sampler's cost per decode step at batch 256 on a GPU (128,256-token bf16 logits from a
near-flat random-weight row): for each kind of request, the device time of ``Sampler.launch``
(``do_bench``) and its host time (launches queued behind a long device sleep, so the host never
waits), against greedy's.

``python benchmarks/scripts/sampler_step.py [--output F]``"""
from __future__ import annotations

import json
import sys
import time

import torch
from triton.testing import do_bench

from kvos.bench.sampling import KINDS
from kvos.core.sampling_params import SamplingParams
from kvos.worker.sampler import Sampler, SampleRow

output = sys.argv[sys.argv.index("--output") + 1] if "--output" in sys.argv else None
R, V = 256, 128256
dev = torch.device("cuda")
torch.manual_seed(0)
logits = (torch.randn(R, V, device=dev) * 2).bfloat16()
sampler = Sampler()
out: dict = {"device": torch.cuda.get_device_name(), "rows": R, "vocab": V, "kinds": {}}
for kind, kw in KINDS.items():
    rows = [SampleRow(i, SamplingParams(max_tokens=16, **kw)) for i in range(R)]
    device_ms = do_bench(lambda: sampler.launch(logits, rows))
    n = 200
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about a second of device time ahead of the launches
    t0 = time.perf_counter()
    for _ in range(n):
        sampler.launch(logits, rows)
    host_ms = (time.perf_counter() - t0) / n * 1e3
    torch.cuda.synchronize()
    out["kinds"][kind] = {"device_ms": round(device_ms, 4), "host_ms": round(host_ms, 4)}
    print(kind, out["kinds"][kind], flush=True)
print(json.dumps(out, indent=1))
if output:
    with open(output, "w") as f:
        json.dump(out, f, indent=1)
