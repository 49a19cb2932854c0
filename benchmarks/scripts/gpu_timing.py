"""Timing helpers shared by the GPU probes in this folder (run them as ``python
benchmarks/scripts/<probe>.py``, which puts this folder on the import path)."""
import statistics

import torch


def timed(fn, reps: int = 25, warmup: int = 3) -> float:
    """Median milliseconds of ``fn()`` over ``reps`` calls, each between two CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def copy_rate(device: str = "cuda") -> float:
    """Bytes per second of a 4 GiB device copy (read and write counted)."""
    src = torch.empty(4 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() / timed(lambda: dst.copy_(src), 10) * 1e3
