"""Tile sweep of the paged attention kernels over 8-bit caches against the bf16 cache (H100):
Llama-3.1-8B's attention shape (32 heads, 8 KV heads, head_dim 128), block 16, random tables."""
import statistics
import sys

import torch

from kvos.kernels import decode_attention as D
from kvos.kernels import prefill_attention as P
from kvos.kernels.kv_quant import quantize

torch.manual_seed(0)
dev = "cuda"
H, KVH, HD, BS = 32, 8, 128, 16
NB = 40000


def timed(fn, reps=20):
    for _ in range(3):
        fn()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


kb = torch.randn(NB, BS, KVH, HD, device=dev, dtype=torch.bfloat16)
vb = torch.randn(NB, BS, KVH, HD, device=dev, dtype=torch.bfloat16)
caches = {"bf16": (kb, vb, None, None)}
for name in ("fp8_e4m3", "int8"):
    kq, ks = quantize(kb, name)
    vq, vs = quantize(vb, name)
    # the engine's page stores one head's scales of a block together: [blocks, kv_heads, block_size]
    ks, vs = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (ks, vs))
    caches[name] = (kq, vq, ks, vs)
mode = sys.argv[1] if len(sys.argv) > 1 else "decode"
if mode == "decode":
    orig = D.decode_tiles
    for batch, ctx in ((64, 32768), (256, 8192)):
        nblk = ctx // BS
        tables = torch.randint(1, NB, (batch, nblk), dtype=torch.int32, device=dev)
        lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
        q = torch.randn(batch, H, HD, device=dev, dtype=torch.bfloat16)
        bf = timed(lambda: D.paged_decode_attention(q, kb, vb, tables, lens, 0.088))
        ideal = batch * ctx * KVH * HD * 2 * 2 / 3.0e12 * 1e3
        print(f"decode b={batch} ctx={ctx}: bf16 {bf:.3f} ms (ideal at 3.0 TB/s {ideal:.3f})", flush=True)
        for name in ("fp8_e4m3", "int8"):
            k, v, ks, vs = caches[name]
            for bn, w, st in ((128, 4, 2), (128, 4, 3), (128, 4, 4), (256, 4, 3), (256, 4, 4)):
                D.decode_tiles = lambda *a, bn=bn, w=w, st=st: D.DecodeTiles(bn, w, st, programs_per_sm=2)
                try:
                    t = timed(lambda: D.paged_decode_attention(q, k, v, tables, lens, 0.088, k_scale=ks, v_scale=vs))
                    print(f"  {name} BLOCK_N={bn} warps={w} stages={st}: {t:.3f} ms ({bf / t:.2f}x bf16)", flush=True)
                except Exception as e:  # out of shared memory
                    print(f"  {name} BLOCK_N={bn} warps={w} stages={st}: failed {type(e).__name__}", flush=True)
            D.decode_tiles = orig
else:
    orig = P.quantized_prefill_tiles
    ctx, n = 16384, 2048
    nblk = ctx // BS
    tables = torch.randint(1, NB, (1, nblk), dtype=torch.int32, device=dev)
    q = torch.randn(n, H, HD, device=dev, dtype=torch.bfloat16)
    loc = torch.tensor([0, n], dtype=torch.int32, device=dev)
    lens = torch.tensor([ctx], dtype=torch.int32, device=dev)
    bf = timed(lambda: P.paged_prefill_attention(q, kb, vb, tables, loc, lens, n, 0.088))
    print(f"prefill chunk {n} at ctx {ctx}: bf16 {bf:.3f} ms", flush=True)
    for name in ("fp8_e4m3", "int8"):
        k, v, ks, vs = caches[name]
        for bn, w, st in ((64, 4, 2), (128, 4, 2), (128, 4, 3), (128, 8, 2)):
            P.quantized_prefill_tiles = lambda *a, bn=bn, w=w, st=st: (bn, w, st)
            try:
                t = timed(lambda: P.paged_prefill_attention(q, k, v, tables, loc, lens, n, 0.088, k_scale=ks, v_scale=vs))
                print(f"  {name} BLOCK_N={bn} warps={w} stages={st}: {t:.3f} ms ({bf / t:.2f}x bf16)", flush=True)
            except Exception as e:
                print(f"  {name} BLOCK_N={bn} warps={w} stages={st}: failed {type(e).__name__}", flush=True)
        P.quantized_prefill_tiles = orig
