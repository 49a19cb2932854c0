"""``write_kv`` of 64, 256 and 2,048 rows (Llama-3.1-8B: 8 kv heads x 128, random slots) into
bf16, fp8 and int8 caches: the quantizing writes' cost over the plain copy, on the GPU alone (32
writes captured in one CUDA graph, per write). Prints JSON lines (GPU only); the fp8 write also
with each launch variant (``cache_write.FP8_WRITE_SPLIT``: K and V rows in programs of their own;
``FP8_WRITE_UNROLL``: candidates per loop iteration).

    python benchmarks/scripts/write_kv_speed.py
"""
import json

import torch

from kvos.bench.roofline import cuda_graph_ms as graph_ms
from kvos.kernels import cache_write as C
from kvos.kernels.kv_quant import quantize

dev = "cuda"
KVH, HD, BS, NB = 8, 128, 16, 4096
kb = torch.randn(NB, BS, KVH, HD, device=dev, dtype=torch.bfloat16)
vb = kb.clone()
caches = {"fp8_e4m3": quantize(kb, "fp8_e4m3"), "int8": quantize(kb, "int8")}
print(json.dumps({"gpu": torch.cuda.get_device_name()}), flush=True)
for T in (64, 256, 2048):
    k = torch.randn(T, KVH, HD, device=dev, dtype=torch.bfloat16)
    v = torch.randn(T, KVH, HD, device=dev, dtype=torch.bfloat16)
    slots = torch.randperm(NB * BS, device=dev)[:T].to(torch.int64)
    row = {"T": T, "bf16_ms": round(graph_ms(lambda: C.write_kv(k, v, kb, vb, slots)), 5)}
    for dt, (q, s) in caches.items():
        kq, vq, ks, vs = q.clone(), q.clone(), s.clone(), s.clone()
        row[f"{dt}_ms"] = round(graph_ms(lambda: C.write_kv(k, v, kq, vq, slots, k_scale=ks, v_scale=vs)), 5)
    kept = C.FP8_WRITE_SPLIT, C.FP8_WRITE_UNROLL
    (q, s), ref = caches["fp8_e4m3"], None
    for split, unroll in ((False, 1), (True, 1), (False, 2), (True, 2), (True, 4)):
        C.FP8_WRITE_SPLIT, C.FP8_WRITE_UNROLL = split, unroll
        kq, vq, ks, vs = q.clone(), q.clone(), s.clone(), s.clone()
        row[f"fp8_split{int(split)}_unroll{unroll}_ms"] = round(
            graph_ms(lambda: C.write_kv(k, v, kq, vq, slots, k_scale=ks, v_scale=vs)), 5)
        out = [x.view(torch.uint8) if x.dtype != torch.float32 else x for x in (kq, vq, ks, vs)]
        ref = ref or out
        row[f"fp8_split{int(split)}_unroll{unroll}_same"] = all(torch.equal(a, b) for a, b in zip(out, ref))
    C.FP8_WRITE_SPLIT, C.FP8_WRITE_UNROLL = kept
    print(json.dumps(row), flush=True)
