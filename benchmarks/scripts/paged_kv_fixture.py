"""Shared set-up of the decode-kernel probes (H100): Llama-3.1-8B's attention shape (32 heads,
8 KV heads, head_dim 128), block 16, a pool of random bf16 K/V, its 8-bit copies with their scales
laid out as the engine's pages store them, and a timer that keeps the host's launch work out of
the measurement."""
import statistics

import torch

from kvos.kernels.kv_quant import quantize

H, KVH, HD, BS = 32, 8, 128, 16
NB = 40000
DEVICE = "cuda"


def timed(fn, reps: int = 7, inner: int = 10) -> float:
    """Milliseconds per call: median over reps of the mean of ``inner`` back-to-back calls, so the
    host's launch work overlaps the kernels queued before it and is not counted."""
    for _ in range(3):
        fn()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(inner):
            fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / inner)
    return statistics.median(ts)


def random_pool(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 K and V pools ``[NB, BS, KVH, HD]`` of standard normal values."""
    torch.manual_seed(seed)
    k = torch.randn(NB, BS, KVH, HD, device=DEVICE, dtype=torch.bfloat16)
    v = torch.randn(NB, BS, KVH, HD, device=DEVICE, dtype=torch.bfloat16)
    return k, v


def quantized_pool(k: torch.Tensor, v: torch.Tensor, kv_dtype: str, chunk: int = 2000):
    """(k, v, k_scale, v_scale) in ``kv_dtype``, quantized a chunk of blocks at a time (the scale
    search holds several candidates per row). Scales are stored ``[blocks, kv_heads, block_size]``
    as in the engine's page and viewed ``[blocks, block_size, kv_heads]``."""
    out = []
    for x in (k, v):
        parts = [quantize(x[i:i + chunk], kv_dtype) for i in range(0, x.shape[0], chunk)]
        out.append((torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])))
    (kq, ks), (vq, vs) = out
    ks, vs = (s.transpose(1, 2).contiguous().transpose(1, 2) for s in (ks, vs))
    return kq, vq, ks, vs
