"""FP8-cache decode kernel against the bf16 cache's at the engine's tiles and a sweep of others,
on whichever GPU runs it (written for the H200: #42's fp8 decode steps at 66-71% of roofline).
Llama-3.1-8B's attention shape (32 heads, 8 KV heads, head_dim 128), block 16, random tables.
Prints JSON lines: per shape the bf16 time, the K/V-bytes roofline at a measured copy rate, and
per tile choice the fp8 time."""
import json
import statistics

import torch

from kvos.kernels import decode_attention as D
from kvos.kernels.kv_quant import quantize

torch.manual_seed(0)
dev = "cuda"
H, KVH, HD, BS = 32, 8, 128, 16
NB = 36000


def timed(fn, reps=25):
    for _ in range(3):
        fn()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def copy_rate() -> float:
    """Bytes per second of a large device copy (read + write counted)."""
    src = torch.empty(4 << 30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    return 2 * src.numel() / timed(lambda: dst.copy_(src), 10) * 1e3


bw = copy_rate()
kb = torch.randn(NB, BS, KVH, HD, device=dev, dtype=torch.bfloat16)
vb = torch.randn(NB, BS, KVH, HD, device=dev, dtype=torch.bfloat16)


def quantized(x):
    parts = [quantize(x[i: i + 1000], "fp8_e4m3") for i in range(0, NB, 1000)]  # (quantize's search is large)
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


kq, ks = quantized(kb)
vq, vs = quantized(vb)
ks, vs = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (ks, vs))
print(json.dumps({"gpu": torch.cuda.get_device_name(), "copy_tb_s": bw / 1e12}), flush=True)
orig = D.decode_tiles
CHOICES = [None, (128, 4, 5, 2), (128, 4, 4, 4), (128, 4, 3, 4), (128, 8, 5, 4), (64, 4, 5, 4), (64, 4, 3, 4),
           (256, 4, 3, 2), (256, 8, 3, 4), (128, 4, 5, 8), (128, 4, 6, 4)]
for batch, ctx in ((64, 2048), (64, 8192), (64, 32768), (256, 2048), (256, 8192), (32, 16384)):
    nblk = ctx // BS
    tables = torch.randint(1, NB, (batch, nblk), dtype=torch.int32, device=dev)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    q = torch.randn(batch, H, HD, device=dev, dtype=torch.bfloat16)
    bf = timed(lambda: D.paged_decode_attention(q, kb, vb, tables, lens, 0.088))
    row = {"batch": batch, "ctx": ctx, "bf16_ms": bf,
           "bf16_roofline_ms": batch * ctx * KVH * HD * 2 * 2 / bw * 1e3,
           "fp8_roofline_ms": batch * ctx * KVH * (HD + 4) * 2 / bw * 1e3, "fp8": {}}
    for c in CHOICES:
        if c is not None:
            D.decode_tiles = lambda *a, c=c: D.DecodeTiles(*c)
        try:
            row["fp8"][str(c or "engine")] = timed(
                lambda: D.paged_decode_attention(q, kq, vq, tables, lens, 0.088, k_scale=ks, v_scale=vs))
        except Exception as e:  # out of shared memory
            row["fp8"][str(c)] = f"failed {type(e).__name__}"
        D.decode_tiles = orig
    print(json.dumps(row), flush=True)
