"""The fp8 decode kernel's launch shape (``decode_tiles``): the engine's choice against others, at
short and long contexts, one layer of Llama-3.1-8B heads, V token-minor, each call inside a CUDA
graph as the engine's decode steps are, tables 2,048 blocks wide as in the engine's graphs (so
the splits are the engine's). Prints JSON lines (GPU only); every shape is checked against the
engine's result.

    python benchmarks/scripts/decode_tiles.py
"""
import json

import torch

from kvos.bench.roofline import cuda_graph_ms as graph_ms
from kvos.kernels import decode_attention as D
from kvos.kernels.decode_attention import DecodeTiles
dev = "cuda"
H, KVH, HD, BS, NB, W = 32, 8, 128, 16, 36000, 2048
kb = torch.randn(NB, BS, KVH, HD, device=dev, dtype=torch.bfloat16); vb = torch.randn_like(kb)
kq = torch.randn(NB, BS, KVH, HD, device=dev).to(torch.float8_e4m3fn)
vq = torch.randn(NB, BS, KVH, HD, device=dev).to(torch.float8_e4m3fn).permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
ks = torch.rand(NB, KVH, BS, device=dev).transpose(1, 2); vs = torch.rand(NB, KVH, BS, device=dev).transpose(1, 2)
orig = D.decode_tiles
CONFIGS = {"engine": None, "before": DecodeTiles(128, 4, 5, 4), "64w2s3p4": DecodeTiles(64, 2, 3, 4), "64w2s4p4": DecodeTiles(64, 2, 4, 4),
           "64w2s2p4": DecodeTiles(64, 2, 2, 4), "64w2s3p8": DecodeTiles(64, 2, 3, 8), "128w2s3p4": DecodeTiles(128, 2, 3, 4),
           "32w1s3p8": DecodeTiles(32, 1, 3, 8), "64w1s3p8": DecodeTiles(64, 1, 3, 8), "64w2s5p4": DecodeTiles(64, 2, 5, 4)}
print(json.dumps({"gpu": torch.cuda.get_device_name()}), flush=True)
for batch, ctx in ((256, 256), (256, 512), (64, 512), (1, 2048), (64, 8192), (256, 8192), (64, 32768), (256, 32768)):
    tables = torch.randint(1, NB, (batch, W), dtype=torch.int32, device=dev)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    q = torch.randn(batch, H, HD, device=dev, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    D.decode_tiles = orig
    N, R = (4, 5) if ctx >= 8192 else (32, 15)
    row = {"batch": batch, "ctx": ctx, "bf16": round(graph_ms(lambda: D.paged_decode_attention(q, kb, vb, tables, lens, 0.088, out=out), N, R), 4)}
    ref = D.paged_decode_attention(q, kq, vq, tables, lens, 0.088, k_scale=ks, v_scale=vs).float()
    for name, t in CONFIGS.items():
        D.decode_tiles = orig if t is None else (lambda *a, t=t: t)
        row[name] = round(graph_ms(lambda: D.paged_decode_attention(q, kq, vq, tables, lens, 0.088, out=out, k_scale=ks, v_scale=vs), N, R), 4)
        o = D.paged_decode_attention(q, kq, vq, tables, lens, 0.088, k_scale=ks, v_scale=vs).float()
        assert (o - ref).abs().max().item() < 1e-2, name
    print(json.dumps(row), flush=True)
D.decode_tiles = orig
