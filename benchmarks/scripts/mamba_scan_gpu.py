"""The chunked prefill scan (``kvos.kernels.mamba_scan``) on a GPU at Bamba-9B's layer shape
(128 heads x 64, one group of state 256), one 2,048-token sequence from zeros with a save every
256 tokens: time per call for chunk sizes 128 and 256, its bytes over the measured copy bandwidth,
and the difference from the torch form (``ssd_chunk`` per 256-token piece); then x, B and C in
bfloat16 (as the convolution gives them on bf16 models)."""
import sys

import torch

from kvos.kernels import mamba_scan
from kvos.models.mamba import ssd_chunk
from kvos.models.state import SeqStates

T, H, P, N, G = 2048, 128, 64, 256, 1
dev = "cuda"
g = torch.Generator(device=dev).manual_seed(0)
x = torch.randn(T, H, P, device=dev, generator=g)
dt = torch.rand(T, H, device=dev, generator=g) * 0.1
A, D = -torch.rand(H, device=dev, generator=g) - 0.5, torch.randn(H, device=dev, generator=g)
B, C = torch.randn(T, G, N, device=dev, generator=g) / 16, torch.randn(T, G, N, device=dev, generator=g) / 16
ssm = torch.zeros(20, H, P, N, device=dev)
seq = SeqStates(0, T, -1, [(b, 1 + b // 256) for b in range(256, T + 1, 256)])


def timed(fn, reps=20):
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


ref = torch.empty(T, H, P, device=dev)
Bh, Ch = B.repeat_interleave(H // G, 1), C.repeat_interleave(H // G, 1)


def torch_form():
    h = torch.zeros(H, P, N, device=dev)
    for lo in range(0, T, 256):
        out, h = ssd_chunk(x[lo:lo + 256], dt[lo:lo + 256], A, Bh[lo:lo + 256], Ch[lo:lo + 256], h)
        ref[lo:lo + 256] = out + D[:, None] * x[lo:lo + 256]
    final[:] = h


final = torch.empty(H, P, N, device=dev)


print(f"torch form: {timed(torch_form, 5):.3f} ms")
for chunk in [int(c) for c in (sys.argv[1:] or [128, 256])]:
    chunks = mamba_scan.scan_chunks([seq], 0, torch.device(dev), chunk=chunk)
    y = torch.empty(T, H, P, device=dev)
    for exact in (False, True):
        ms = timed(lambda: mamba_scan.chunked_scan(chunks, x, dt, A, B, C, D, ssm, y, exact=exact, chunk=chunk))
        nc = chunks.num_chunks
        moved = 4 * (3 * x.numel() + 4 * nc * H * P * N + 2 * T * G * N * 2)
        err = ((y - ref).abs().max() / ref.abs().max()).item()
        print(f"chunk {chunk} exact={exact}: {ms:.3f} ms/call, {moved / ms / 1e6:.0f} GB/s moved, "
              f"max err {err:.2e} of max |y|, final state's {((ssm[T // 256 + 1] - final).abs().max() / final.abs().max()).item():.1e}")

chunks = mamba_scan.scan_chunks([seq], 0, torch.device(dev))
y = torch.empty(T, H, P, device=dev)
xb, Bb, Cb = x.bfloat16(), B.bfloat16(), C.bfloat16()  # the convolution's output on bf16 models
ms = timed(lambda: mamba_scan.chunked_scan(chunks, xb, dt, A, Bb, Cb, D, ssm, y))
print(f"chunk 256, x/B/C in bfloat16: {ms:.3f} ms/call, max err {((y - ref).abs().max() / ref.abs().max()).item():.2e} "
      "of max |y| (float32 inputs' torch form)")
for bn, sw, cw in [(64, 4, 4), (128, 8, 4), (256, 8, 4), (64, 4, 8), (128, 4, 8), (256, 8, 8)]:
    mamba_scan._STATE_BLOCK_N, mamba_scan._STATE_WARPS, mamba_scan._SCAN_WARPS = bn, sw, cw
    try:
        ms = timed(lambda: mamba_scan.chunked_scan(chunks, x, dt, A, B, C, D, ssm, y))
        print(f"chunk 256, state block_n {bn} warps {sw}, scan warps {cw}: {ms:.3f} ms/call")
    except Exception as e:
        print(f"state block_n {bn} warps {sw}, scan warps {cw}: {type(e).__name__}")
