"""Probe (H100): the 8-bit paged decode kernel's register cap and context splits against the bf16
kernel (shapes and pools: ``paged_kv_fixture.py``; random tables). The kernel waits for each
tile's loads, so the programs resident on an SM (207 registers uncapped: two; capped at 168:
three) are what hides memory latency, and the split count sets how full the last wave is. Prints ms per call (mean of 10 back-to-back calls, median of 7) for each
split count and cap, and the engine's default choice."""
import torch
from paged_kv_fixture import BS, HD, NB, H, quantized_pool, random_pool, timed
from paged_kv_fixture import DEVICE as dev

from kvos.kernels import decode_attention as D

kb, vb = random_pool()
kq, vq, ks, vs = quantized_pool(kb, vb, "fp8_e4m3")
engine_tiles = D.decode_tiles
for batch, ctx in ((64, 32768), (256, 32768), (256, 8192), (64, 8192)):
    tables = torch.randint(1, NB, (batch, ctx // BS), dtype=torch.int32, device=dev)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    q = torch.randn(batch, H, HD, device=dev, dtype=torch.bfloat16)
    bf = timed(lambda: D.paged_decode_attention(q, kb, vb, tables, lens, 0.088))
    fp8 = timed(lambda: D.paged_decode_attention(q, kq, vq, tables, lens, 0.088, k_scale=ks, v_scale=vs))
    print(f"b={batch} ctx={ctx}: engine defaults: bf16 {bf:.3f} ms, fp8 {fp8:.3f} ms ({bf / fp8:.2f}x)", flush=True)
    for splits in (1, 2, 4, 8, 16):
        tb = timed(lambda: D.paged_decode_attention(q, kb, vb, tables, lens, 0.088, num_splits=splits))
        line = f"  splits={splits:2d}: bf16 {tb:.3f}"
        for cap in (None, 168, 128):
            D.decode_tiles = lambda *a, cap=cap: D.DecodeTiles(128, 4, 3, programs_per_sm=2, max_registers=cap)
            t = timed(lambda: D.paged_decode_attention(q, kq, vq, tables, lens, 0.088, k_scale=ks, v_scale=vs,
                                                       num_splits=splits))
            D.decode_tiles = engine_tiles
            line += f" | fp8 cap {cap}: {t:.3f} ({bf / t:.2f}x)"
        print(line, flush=True)
