"""The decode kernel on 8-bit caches with V in the usual layout (read a byte at a time for the
P @ V product) and token-minor (the engine's layout since kv-layout-3, read a block at a time:
``tile_attention.v_pages``), against the bf16 cache and the K/V-bytes roofline at a measured copy
rate. Llama-3.1-8B attention shape, block 16, random tables; prints JSON lines (GPU only).

    python benchmarks/scripts/decode_v_layout.py
"""
import json
from functools import partial

from kvos.bench.roofline import cuda_median_ms, measure_ceilings
import torch, triton
from kvos.kernels import decode_attention as D
from paged_kv_fixture import quantized_pool

torch.manual_seed(0)
dev = "cuda"
timed = partial(cuda_median_ms, reps=30)
H, KVH, HD, BS = 32, 8, 128, 16
NB = 36000
bw = measure_ceilings(dev)["hbm_GBps"] * 1e9
kb = torch.randn(NB, BS, KVH, HD, device=dev, dtype=torch.bfloat16)
vb = torch.randn(NB, BS, KVH, HD, device=dev, dtype=torch.bfloat16)
print(json.dumps({"gpu": torch.cuda.get_device_name(), "triton": triton.__version__, "copy_tb_s": bw / 1e12}), flush=True)
caches = {}
for dt in ("fp8_e4m3", "int8"):
    kq, vq, ks, vs = quantized_pool(kb, vb, dt, chunk=1000)
    caches[dt] = (kq, vq, vq.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2), ks, vs)
for batch, ctx in ((1, 8192), (64, 2048), (64, 8192), (64, 32768), (256, 2048), (256, 8192), (32, 16384)):
    tables = torch.randint(1, NB, (batch, ctx // BS), dtype=torch.int32, device=dev)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    q = torch.randn(batch, H, HD, device=dev, dtype=torch.bfloat16)
    bf = timed(lambda: D.paged_decode_attention(q, kb, vb, tables, lens, 0.088))
    roof8 = batch * ctx * KVH * (HD + 4) * 2 / bw * 1e3
    row = {"batch": batch, "ctx": ctx, "bf16_ms": round(bf, 4),
           "bf16_of_roof": round(batch * ctx * KVH * HD * 4 / bw * 1e3 / bf, 3), "roof8_ms": round(roof8, 4)}
    for dt, (kq, vq, vt, ks, vs) in caches.items():
        for name, v in (("usual", vq), ("token_minor", vt)):
            t = timed(lambda: D.paged_decode_attention(q, kq, v, tables, lens, 0.088, k_scale=ks, v_scale=vs))
            row[f"{dt}_{name}_ms"] = round(t, 4)
            row[f"{dt}_{name}_of_roof"] = round(roof8 / t, 3)
            row[f"{dt}_{name}_vs_bf16"] = round(bf / t, 3)
        a = D.paged_decode_attention(q, kq, vq, tables, lens, 0.088, k_scale=ks, v_scale=vs).float()
        b = D.paged_decode_attention(q, kq, vt, tables, lens, 0.088, k_scale=ks, v_scale=vs).float()
        row[f"{dt}_layouts_max_diff"] = (a - b).abs().max().item()
    print(json.dumps(row), flush=True)
