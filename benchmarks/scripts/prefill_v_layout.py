"""The prefill kernel on 8-bit caches with V in the usual layout and token-minor (the engine's
since kv-layout-3) against the bf16 cache: 2,048- and 8,192-token chunks over their contexts,
Llama-3.1-8B attention shape, block 16, random tables; then ``write_kv`` of 2,048 tokens. Prints
JSON lines (GPU only).

    python benchmarks/scripts/prefill_v_layout.py
"""
import json
from functools import partial

from kvos.bench.roofline import cuda_median_ms
import torch
from kvos.kernels import prefill_attention as P
from kvos.kernels.cache_write import write_kv
from paged_kv_fixture import quantized_pool

torch.manual_seed(0)
dev = "cuda"
timed = partial(cuda_median_ms, reps=15, warmup=2)
H, KVH, HD, BS = 32, 8, 128, 16
NB = 20000
kb = torch.randn(NB, BS, KVH, HD, device=dev, dtype=torch.bfloat16)
vb = torch.randn(NB, BS, KVH, HD, device=dev, dtype=torch.bfloat16)
kq, vq, ks, vs = quantized_pool(kb, vb, "fp8_e4m3", chunk=1000)
vt = vq.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
for nseq, chunk, ctx in ((1, 2048, 16384), (1, 2048, 4096), (4, 2048, 2048), (1, 8192, 8192)):
    tables = torch.randint(1, NB, (nseq, ctx // BS), dtype=torch.int32, device=dev)
    lens = torch.full((nseq,), ctx, dtype=torch.int32, device=dev)
    q = torch.randn(nseq * chunk, H, HD, device=dev, dtype=torch.bfloat16)
    qsl = torch.arange(0, nseq + 1, device=dev, dtype=torch.int32) * chunk
    row = {"seqs": nseq, "chunk": chunk, "ctx": ctx}
    row["bf16_ms"] = timed(lambda: P.paged_prefill_attention(q, kb, vb, tables, qsl, lens, chunk, 0.088))
    for name, v in (("fp8_usual", vq), ("fp8_token_minor", vt)):
        row[name + "_ms"] = timed(lambda: P.paged_prefill_attention(q, kq, v, tables, qsl, lens, chunk, 0.088,
                                                                    k_scale=ks, v_scale=vs))
    a = P.paged_prefill_attention(q, kq, vq, tables, qsl, lens, chunk, 0.088, k_scale=ks, v_scale=vs).float()
    b = P.paged_prefill_attention(q, kq, vt, tables, qsl, lens, chunk, 0.088, k_scale=ks, v_scale=vs).float()
    row["layouts_max_diff"] = (a - b).abs().max().item()
    print(json.dumps(row), flush=True)
# write_kv of a 2,048-token chunk: bf16, fp8 usual, fp8 token-minor
T = 2048
k = torch.randn(T, KVH, HD, device=dev, dtype=torch.bfloat16)
v = torch.randn(T, KVH, HD, device=dev, dtype=torch.bfloat16)
slots = torch.randperm(NB * BS // 2, device=dev)[:T].to(torch.int64)
w = {"write_tokens": T, "bf16_ms": timed(lambda: write_kv(k, v, kb, vb, slots))}
for name, vc in (("fp8_usual", vq), ("fp8_token_minor", vt)):
    w[name + "_ms"] = timed(lambda: write_kv(k, v, kq, vc, slots, k_scale=ks, v_scale=vs))
print(json.dumps(w), flush=True)
