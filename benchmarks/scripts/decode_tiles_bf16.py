"""The bf16 decode kernel's launch shape (``decode_tiles`` for 16-bit caches): the engine's
choice against smaller programs, more per SM (what ``QUANTIZED_TILES`` found for 8-bit caches),
at the contexts of the throughput workloads and long ones; one layer of Llama-3.1-8B heads,
each call inside a CUDA graph as the engine's decode steps are, tables 2,048 blocks wide as in
the engine's graphs (so the splits are the engine's). Prints JSON lines (GPU only): ms per
configuration and the K/V-bytes rate of the engine's; every shape is checked against the
engine's result.

    python benchmarks/scripts/decode_tiles_bf16.py
"""
import json

import torch

from kvos.bench.roofline import cuda_graph_ms as graph_ms
from kvos.kernels import decode_attention as D
from kvos.kernels.decode_attention import DecodeTiles

dev = "cuda"
H, KVH, HD, BS, NB, W = 32, 8, 128, 16, 36000, 2048
kb = torch.randn(NB, BS, KVH, HD, device=dev, dtype=torch.bfloat16)
vb = torch.randn_like(kb)
orig = D.decode_tiles
CONFIGS = {"engine": None, "64w4s2p4": DecodeTiles(64, 4, 2, 4), "64w4s2p8": DecodeTiles(64, 4, 2, 8),
           "32w2s3p8": DecodeTiles(32, 2, 3, 8), "32w1s3p8": DecodeTiles(32, 1, 3, 8),
           "64w2s3p4": DecodeTiles(64, 2, 3, 4), "64w2s3p8": DecodeTiles(64, 2, 3, 8),
           "32w2s4p8": DecodeTiles(32, 2, 4, 8), "64w4s3p4": DecodeTiles(64, 4, 3, 4)}
print(json.dumps({"gpu": torch.cuda.get_device_name()}), flush=True)
for batch, ctx in ((32, 512), (64, 512), (128, 512), (256, 512), (32, 2048), (256, 2048), (64, 8192),
                   (256, 8192), (64, 32768)):
    tables = torch.randint(1, NB, (batch, W), dtype=torch.int32, device=dev)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    q = torch.randn(batch, H, HD, device=dev, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    N, R = (4, 5) if ctx >= 8192 else (32, 15)
    D.decode_tiles = orig
    ref = D.paged_decode_attention(q, kb, vb, tables, lens, 0.088).float()
    row = {"batch": batch, "ctx": ctx}
    for name, t in CONFIGS.items():
        D.decode_tiles = orig if t is None else (lambda *a, t=t: t)
        row[name] = round(graph_ms(lambda: D.paged_decode_attention(q, kb, vb, tables, lens, 0.088, out=out), N, R), 4)
        o = D.paged_decode_attention(q, kb, vb, tables, lens, 0.088).float()
        assert (o - ref).abs().max().item() < 2e-2, name
    D.decode_tiles = orig
    row["engine_TBps"] = round(batch * ctx * KVH * HD * 2 * 2 / row["engine"] / 1e9, 2)
    print(json.dumps(row), flush=True)
