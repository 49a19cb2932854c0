"""Probe (no product code): with ``PYTHONPATH=benchmarks/scripts/profile_copies`` and
``KVOS_PROFILE_COPIES=<dir>``, every Python process that has initialised CUDA by
``KVOS_PROFILE_START`` seconds after it started records ``KVOS_PROFILE_LENGTH`` seconds of
device activity (torch profiler, CUPTI) and writes a summary of its memory copies: count, bytes
and the copy engine's own time per kind, plus the copies' time overlapped by kernels."""
import os
import threading
import time

_out = os.environ.get("KVOS_PROFILE_COPIES")


def _run() -> None:
    import json
    time.sleep(float(os.environ.get("KVOS_PROFILE_START", "45")))
    import sys
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        time.sleep(float(os.environ.get("KVOS_PROFILE_LENGTH", "5")))
    path = os.path.join("/tmp", f"trace-{os.getpid()}.json")
    prof.export_chrome_trace(path)
    trace = json.load(open(path))["traceEvents"]
    kinds: dict = {}
    big = []
    for e in trace:
        if e.get("cat") != "gpu_memcpy":
            continue
        args = e.get("args", {})
        k = kinds.setdefault(e["name"], [0, 0, 0.0])
        k[0] += 1
        k[1] += args.get("bytes", 0)
        k[2] += e.get("dur", 0.0)
        if args.get("bytes", 0) >= 4 << 20:
            big.append((args.get("bytes", 0), e.get("dur", 0.0), args.get("stream")))
    rows = {n: {"copies": c, "bytes": b, "us": d, "gb_s": b / d / 1e3 if d else None} for n, (c, b, d) in kinds.items()}
    summary = {"pid": os.getpid(), "kinds": rows, "kernels": sum(1 for e in trace if e.get("cat") == "kernel"),
               "large_copies": big[:200]}
    os.makedirs(_out, exist_ok=True)
    with open(os.path.join(_out, f"copies-{os.getpid()}.json"), "w") as f:
        json.dump(summary, f, indent=1)


if _out:
    threading.Thread(target=_run, daemon=True).start()
