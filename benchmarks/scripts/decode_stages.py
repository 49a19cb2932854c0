"""Probe (H100): pipeline stages of the paged decode kernel, bf16 and 8-bit caches.

Triton 3.6's pipeliner keeps one shared-memory buffer per K/V tile up to ``num_stages=4`` here:
the next tile's loads are issued after the current tile is computed and waited for at the top of
the next iteration, so a program never overlaps its loads with its math. From 5 stages on it
double-buffers (two K and two V tiles, waits that leave the next tile's copies in flight), from 7
it triple-buffers; shared memory per program grows accordingly (128-key 8-bit tiles at cap 168:
42, 77 and 111 KB at 3, 5 and 7 stages), which bounds the programs per SM. Sweeps keys per tile,
stages, register cap and the split target (programs per SM) on the engine's kernel
(``decode_tiles`` replaced for the run). Shapes and pools: ``paged_kv_fixture.py``; random
tables. Prints ms per call and the speed-up over the engine's bf16 kernel as it is."""
import itertools
import json
import os
import sys

import torch
from paged_kv_fixture import BS, HD, NB, H, quantized_pool, random_pool, timed
from paged_kv_fixture import DEVICE as dev

from kvos.kernels import decode_attention as D

engine_tiles = D.decode_tiles
kb, vb = random_pool()
pools = {"bf16": (kb, vb, None, None)}
for name in sys.argv[1:] or ["fp8_e4m3", "int8"]:
    pools[name] = quantized_pool(kb, vb, name)
SWEEP = {
    "bf16": list(itertools.product((64, 32), (2, 3, 4, 5, 6), (None,), (2, 4))),
    "8bit": list(itertools.product((128, 64), (3, 5, 7), (None, 168), (4, 8))),
}
report = []
for batch, ctx in ((64, 32768), (256, 32768), (64, 8192), (256, 8192)):
    tables = torch.randint(1, NB, (batch, ctx // BS), dtype=torch.int32, device=dev)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    q = torch.randn(batch, H, HD, device=dev, dtype=torch.bfloat16)
    bf = timed(lambda: D.paged_decode_attention(q, kb, vb, tables, lens, 0.088))
    print(f"b={batch} ctx={ctx}: engine bf16 {bf:.3f} ms", flush=True)
    for name, (k, v, ks, vs) in pools.items():
        run = lambda: D.paged_decode_attention(q, k, v, tables, lens, 0.088, k_scale=ks, v_scale=vs)
        base = timed(run)
        results = []
        for bn, stages, cap, per_sm in SWEEP["bf16" if ks is None else "8bit"]:
            D.decode_tiles = lambda *a, t=D.DecodeTiles(bn, 4, stages, programs_per_sm=per_sm, max_registers=cap): t
            try:
                t = timed(run)
                results.append((t, f"N={bn} st={stages} cap={cap} per_sm={per_sm}"))
            except Exception as e:  # out of shared memory, for instance
                print(f"    N={bn} st={stages} cap={cap} per_sm={per_sm}: {type(e).__name__} {str(e)[:120]}")
            D.decode_tiles = engine_tiles
        results.sort()
        report.append({"batch": batch, "context": ctx, "cache": name, "bf16_engine_ms": bf, "engine_ms": base,
                       "variants": {tag: t for t, tag in results}})
        line = ", ".join(f"{tag}: {t:.3f} ({bf / t:.2f}x)" for t, tag in results[:4])
        print(f"  {name}: engine {base:.3f} ms ({bf / base:.2f}x); best: {line}", flush=True)
        worst = results[-1]
        print(f"    worst: {worst[1]}: {worst[0]:.3f}", flush=True)
if os.environ.get("OUT"):
    with open(os.path.join(os.environ["OUT"], "decode_stages.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "results": report}, f, indent=1)
