"""The one-row weight product (``kvos.kernels.gemv``) against cuBLAS (``F.linear``) on
Llama-3.1-8B's weight shapes, each launch shape, inside a CUDA graph that cycles through
enough copies of the weight (≥ 400 MB) that none is served from L2, as in a decode step where
every layer's weights are new. Prints JSON lines with GB/s of weight read; checks each result
against float64 (GPU only).

    python benchmarks/scripts/gemv_rows.py
"""
import json

import torch
import torch.nn.functional as F

from kvos.bench.roofline import cuda_graph_ms, cycling
from kvos.kernels import gemv
from kvos.kernels.gemv import GemvTiles

SHAPES = {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096), "gate_up_proj": (28672, 4096),
          "down_proj": (4096, 14336), "lm_head": (128256, 4096)}
ONE = [GemvTiles(8, 512, 4, 3), GemvTiles(16, 256, 4, 3), GemvTiles(4, 1024, 4, 3), GemvTiles(8, 256, 4, 4),
       GemvTiles(16, 512, 8, 3), GemvTiles(8, 1024, 8, 2), GemvTiles(32, 128, 4, 4)]
print(json.dumps({"gpu": torch.cuda.get_device_name()}), flush=True)
for name, (n, k) in SHAPES.items():
    copies = max(1, -(-400_000_000 // (n * k * 2)))
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    for m in (1,):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = (x.double() @ ws[0].double().t())
        tol = 2 * ref.abs() * 2 ** -8 + 1e-4
        out = gemv.matmul(x, ws[0])
        assert ((out.double() - ref).abs() <= tol).all(), (name, m)
        row = {"weight": name, "shape": [n, k], "rows": m,
               "cublas_ms": cuda_graph_ms(cycling(lambda w: F.linear(x, w), ws), 2 * copies, 10)}
        best = None
        for t in ONE:
            ms = cuda_graph_ms(cycling(lambda w, t=t: gemv.matmul(x, w, tiles=t), ws), 2 * copies, 10)
            row[f"{t.block_n}x{t.block_k}w{t.warps}s{t.stages}"] = round(ms, 4)
            if best is None or ms < best[0]:
                best = (ms, t)
        row["cublas_ms"] = round(row["cublas_ms"], 4)
        row["best"] = f"{best[1].block_n}x{best[1].block_k}w{best[1].warps}s{best[1].stages}"
        row["cublas_GBps"] = round(n * k * 2 / row["cublas_ms"] / 1e6)
        row["gemv_GBps"] = round(n * k * 2 / best[0] / 1e6)
        print(json.dumps(row), flush=True)
    ws.clear()
