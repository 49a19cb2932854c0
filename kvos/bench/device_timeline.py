"""Where the time of one call goes on the GPU: the call runs once under ``torch.profiler`` and the
device's copies and kernels are read back from its trace, against the call's wall time.

The profiler adds host overhead to every op it records, so the wall time here is longer than an
unprofiled run's; the device intervals (copy and kernel durations, gaps between copies) are
the GPU's own timestamps."""
from __future__ import annotations

import json
import os
import tempfile
from typing import Callable

MARK = "kvos.timed_call"


def _busy(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def device_timeline(fn: Callable[[], object]) -> dict:
    """Run ``fn`` once under the profiler (CUDA must be in use; ``fn`` synchronises before it
    returns) and return milliseconds, all relative to the call's start on the host:
    ``wall``; ``first_h2d_start``; ``h2d_span`` (first host-to-device copy's start to the last
    one's end), ``h2d_busy`` (time any such copy ran) and their difference ``h2d_gaps``;
    ``h2d_copies`` and ``h2d_GBps_while_copying`` (bytes over busy time, where the trace gives
    bytes); ``kernels_after_h2d`` (kernel time after the last copy ended, e.g. checks and
    scatters); ``device_idle_at_end`` (last device activity to the call's end)."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        with record_function(MARK):
            fn()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    finally:
        os.unlink(path)
    mark = next(e for e in events if e.get("name") == MARK and e.get("cat") != "gpu_user_annotation")
    t0, t1 = mark["ts"], mark["ts"] + mark["dur"]
    inside = [e for e in events if t0 <= e["ts"] <= t1]
    h2d = [e for e in inside if e.get("cat") == "gpu_memcpy" and "HtoD" in e.get("name", "")]
    kernels = [e for e in inside if e.get("cat") == "kernel"]
    device = [(e["ts"], e["ts"] + e["dur"]) for e in h2d + kernels
              + [e for e in inside if e.get("cat") in ("gpu_memcpy", "gpu_memset")]]
    out = {"wall_ms": (t1 - t0) / 1e3, "h2d_copies": len(h2d)}
    if h2d:
        first, last = min(e["ts"] for e in h2d), max(e["ts"] + e["dur"] for e in h2d)
        busy = _busy([(e["ts"], e["ts"] + e["dur"]) for e in h2d])
        out |= {"first_h2d_start_ms": (first - t0) / 1e3, "h2d_span_ms": (last - first) / 1e3,
                "h2d_busy_ms": busy / 1e3, "h2d_gaps_ms": (last - first - busy) / 1e3,
                "kernels_after_h2d_ms": _busy([(s, e) for s, e in
                                               ((k["ts"], k["ts"] + k["dur"]) for k in kernels) if s >= last]) / 1e3}
        nbytes = sum(e.get("args", {}).get("bytes", 0) or 0 for e in h2d)
        if nbytes and busy:
            out["h2d_GBps_while_copying"] = nbytes / (busy * 1e-6) / 1e9
    if device:
        out["device_idle_at_end_ms"] = (t1 - max(e for _, e in device)) / 1e3
    return out
