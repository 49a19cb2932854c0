"""Prefill chunks over an fp8 cache (V token-minor, the engine's layout): the 8-bit kernel
directly against a dequantized scratch copy first (``dequantize_pages``, then the bf16 kernel),
and the bf16 cache. Llama-3.1-8B attention shape, block 16, random tables, eager calls as the
engine makes them (host launch included). Prints JSON lines (GPU only).

    python benchmarks/scripts/prefill_dequantized.py
"""
import json
from functools import partial

import torch
from paged_kv_fixture import quantized_pool

from kvos.bench.roofline import cuda_median_ms
from kvos.kernels import prefill_attention as P

torch.manual_seed(0)
dev = "cuda"
timed = partial(cuda_median_ms, reps=15, warmup=2)
H, KVH, HD, BS, NB = 32, 8, 128, 16, 20000
kb = torch.randn(NB, BS, KVH, HD, device=dev, dtype=torch.bfloat16)
vb = torch.randn(NB, BS, KVH, HD, device=dev, dtype=torch.bfloat16)
kq, vq, ks, vs = quantized_pool(kb, vb, "fp8_e4m3", chunk=1000)
vq = vq.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
print(json.dumps({"gpu": torch.cuda.get_device_name()}), flush=True)
SHAPES = ((1, 64, 16384), (1, 128, 16384), (1, 256, 16384), (1, 512, 16384), (1, 2048, 16384),
          (1, 8192, 16384), (1, 8192, 8192), (1, 256, 1024), (4, 256, 1024), (8, 128, 1024),
          (2, 2048, 32768))
for nseq, chunk, ctx in SHAPES:
    tables = torch.randint(1, NB, (nseq, ctx // BS), dtype=torch.int32, device=dev)
    lens = torch.full((nseq,), ctx, dtype=torch.int32, device=dev)
    q = torch.randn(nseq * chunk, H, HD, device=dev, dtype=torch.bfloat16)
    qsl = torch.arange(0, nseq + 1, device=dev, dtype=torch.int32) * chunk
    args = (tables, qsl, lens, chunk, 0.088)
    row = {"seqs": nseq, "chunk": chunk, "ctx": ctx}
    row["bf16_ms"] = timed(lambda: P.paged_prefill_attention(q, kb, vb, *args))
    row["fp8_direct_ms"] = timed(lambda: P.paged_prefill_attention(q, kq, vq, *args, k_scale=ks, v_scale=vs))
    row["fp8_dequantized_ms"] = timed(lambda: P.paged_prefill_attention(
        q, kq, vq, *args, k_scale=ks, v_scale=vs, max_seq_len=ctx, dequantize_min_query=1))
    a = P.paged_prefill_attention(q, kq, vq, *args, k_scale=ks, v_scale=vs).float()
    b = P.paged_prefill_attention(q, kq, vq, *args, k_scale=ks, v_scale=vs, max_seq_len=ctx,
                                  dequantize_min_query=1).float()
    row["max_diff"] = (a - b).abs().max().item()
    row["direct_over_dequantized"] = round(row["fp8_direct_ms"] / row["fp8_dequantized_ms"], 3)
    print(json.dumps(row), flush=True)
