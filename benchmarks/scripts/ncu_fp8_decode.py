"""One bf16 and one fp8 paged decode launch at 256 sequences x 8K context (Llama-3.1-8B's
attention shape), for Nsight Compute:

    ncu --kernel-name regex:_decode_split_kernel --launch-skip 4 --launch-count 2 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
        --section Occupancy --section LaunchStats --section ComputeWorkloadAnalysis \
        python benchmarks/scripts/ncu_fp8_decode.py
"""
import torch
from kvos.kernels import decode_attention as D
from kvos.kernels.kv_quant import quantize
torch.manual_seed(0)
dev = "cuda"; H, KVH, HD, BS = 32, 8, 128, 16; NB = 20000
kb = torch.randn(NB, BS, KVH, HD, device=dev, dtype=torch.bfloat16)
vb = torch.randn(NB, BS, KVH, HD, device=dev, dtype=torch.bfloat16)
def quantized(x):
    parts = [quantize(x[i: i + 1000], "fp8_e4m3") for i in range(0, NB, 1000)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
kq, ks = quantized(kb); vq, vs = quantized(vb)
ks, vs = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (ks, vs))
batch, ctx = 256, 8192
tables = torch.randint(1, NB, (batch, ctx // BS), dtype=torch.int32, device=dev)
lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
q = torch.randn(batch, H, HD, device=dev, dtype=torch.bfloat16)
for _ in range(3):
    D.paged_decode_attention(q, kb, vb, tables, lens, 0.088)
    D.paged_decode_attention(q, kq, vq, tables, lens, 0.088, k_scale=ks, v_scale=vs)
torch.cuda.synchronize()
