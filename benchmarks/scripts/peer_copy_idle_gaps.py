"""Probe: does a peer copy after an idle gap pay a stall? The decode engine's
hand-overs come tens of ms apart, and about one copy in seven takes 160-180 us more than the
rest (CUPTI, 2 x H200); the earlier probes copied 0.5 ms apart. Here 16 MiB copies (a typical
chat hand-over) run with idle gaps of 0.5 to 200 ms between them, each timed alone on the
device (TimedCopies), and once more with a 4 KiB peer copy queued 1 ms before each one (if the
link sleeps when idle, this wakes it ahead of the real copy). Prints per gap: min, median, p90
and max microseconds and how many copies took over min + 100 us.

Run from the repo root on a host with two GPUs: python3 benchmarks/scripts/peer_copy_idle_gaps.py
Seen on 2 x H200: medians 52-54 us up to 10 ms gaps, 224 us at 50 and 200 ms, 193 us with the
4 KiB copy ahead (benchmarks/results/peer-copy-idle-h200x2.txt)."""
import statistics
import time

from ipc_pair import as_consumer, as_producer, open_shared, run_pair

SIZE = 16 << 20
GAPS_MS = [0.5, 2, 10, 50, 200]
COPIES = 30


def producer(q_out, q_in):
    as_producer()
    import torch
    from torch.multiprocessing.reductions import reduce_tensor
    bufs = [torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda") for n in (SIZE, 4096)]
    torch.cuda.synchronize()
    q_out.put([reduce_tensor(b) for b in bufs])
    q_in.get()  # "stop"


def consumer(q_in, q_out):
    as_consumer()
    import torch

    from kvos.worker.timed_copies import TimedCopies
    src, tiny = open_shared(q_in.get())
    dev = torch.device("cuda:0")
    tc = TimedCopies(dev)
    wake_dst = torch.empty(4096, dtype=torch.uint8, device=dev)
    for _ in range(10):  # first-use costs
        tc.copy(src)
    torch.cuda.synchronize()
    tc.collect()
    for wake in (False, True):
        for gap in GAPS_MS:
            times = []
            for _ in range(COPIES):
                time.sleep(gap / 1000)
                if wake:
                    wake_dst.copy_(tiny)
                    time.sleep(0.001)
                s0 = tc.seconds
                tc.copy(src)
                torch.cuda.synchronize()
                tc.collect()
                times.append((tc.seconds - s0) * 1e6)
            lo = min(times)
            q = statistics.quantiles(times, n=10)
            slow = sum(t > lo + 100 for t in times)
            print(f"gap {gap:6.1f} ms{' +wake' if wake else '      '}: min {lo:7.1f} med {statistics.median(times):7.1f} "
                  f"p90 {q[-1]:7.1f} max {max(times):7.1f} us; {slow}/{COPIES} over min+100 us; "
                  f"{SIZE / statistics.median(times) / 1e3:6.1f} GB/s median", flush=True)
    q_out.put("stop")


if __name__ == "__main__":
    run_pair(producer, consumer)
