"""``write_kv`` of 256 and 2,048 rows (Llama-3.1-8B: 8 kv heads x 128, random slots) into bf16,
fp8 and int8 caches: the quantizing writes' cost over the plain copy. Prints JSON lines (GPU only).

    python benchmarks/scripts/write_kv_speed.py
"""
import json
from functools import partial

from kvos.bench.roofline import cuda_median_ms
import torch
from kvos.kernels import cache_write as C
from kvos.kernels.kv_quant import quantize
dev = "cuda"; KVH, HD, BS, NB = 8, 128, 16, 4096
timed = partial(cuda_median_ms, reps=50)
kb = torch.randn(NB, BS, KVH, HD, device=dev, dtype=torch.bfloat16)
vb = kb.clone()
caches = {"fp8_e4m3": quantize(kb, "fp8_e4m3"), "int8": quantize(kb, "int8")}
for T in (256, 2048):
    k = torch.randn(T, KVH, HD, device=dev, dtype=torch.bfloat16)
    v = torch.randn(T, KVH, HD, device=dev, dtype=torch.bfloat16)
    slots = torch.randperm(NB * BS, device=dev)[:T].to(torch.int64)
    row = {"T": T, "bf16_ms": timed(lambda: C.write_kv(k, v, kb, vb, slots))}
    for dt, (q, s) in caches.items():
        kq, vq, ks, vs = q.clone(), q.clone(), s.clone(), s.clone()
        row[f"{dt}_ms"] = timed(lambda: C.write_kv(k, v, kq, vq, slots, k_scale=ks, v_scale=vs))
    print(json.dumps(row), flush=True)
