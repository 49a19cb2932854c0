"""Probe: what makes a peer copy after an idle gap slow? ``peer_copy_idle_gaps.py`` found that a
16 MiB peer copy takes about 50 us when the previous one ran up to 10 ms before and about 220 us
after 50 ms or more of idle (2 x H200). Here, at gaps of 0.5 and 50 ms, the copy runs:
- ``idle``: both GPUs idle in the gap (the earlier probe's case);
- ``local``: a copy of the same size within the consuming GPU (no NVLink): if it stalls too, the
  cause is the GPU, not the link;
- ``consumer busy``: the consuming GPU runs memory-bound adds through the gap (as a decode
  engine does), the copy on its side stream;
- ``producer busy``: the source GPU runs matrix products through the gap;
- ``keep-alive``: a 4 KiB peer copy every 2 ms through the gap;
- ``pre-touch``: 1 ms before the copy, 4 KiB peer copies out of each 2 MiB page of its source
  (if the stall is the source's address translations, this takes it ahead of the copy);
- ``1 MiB wake``: a 1 MiB peer copy of another buffer 1 ms before the copy;
- ``then another``: right after the copy, a second 16 MiB copy out of another buffer, timed
  alone (``second``): fast if the first copy woke something shared, slow if each buffer pays.
Prints per case: min, median and max microseconds of TimedCopies' device time.

Run from the repo root on a host with two GPUs: python3 benchmarks/scripts/peer_copy_idle_causes.py"""
import statistics
import time

from ipc_pair import as_consumer, as_producer, open_shared, run_pair

SIZE = 16 << 20
COPIES = 20


def producer(q_out, q_in):
    as_producer()
    import torch
    from torch.multiprocessing.reductions import reduce_tensor
    bufs = [torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda") for n in (SIZE, SIZE, 4096, 1 << 20)]
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    q_out.put([reduce_tensor(b) for b in bufs])
    while True:
        msg = q_in.get()
        if msg == "stop":
            break
        if msg == "busy":  # matrix products until told "quiet"
            while q_in.empty():
                for _ in range(20):
                    a @ a
                torch.cuda.synchronize()
            q_in.get()
            q_out.put("quiet")


def consumer(q_in, q_out):
    as_consumer()
    import torch

    from kvos.worker.timed_copies import TimedCopies
    src, other, tiny, wake = open_shared(q_in.get())
    dev = torch.device("cuda:0")
    tc = TimedCopies(dev)
    local = torch.randint(0, 255, (SIZE,), dtype=torch.uint8, device=dev)
    tiny_dst = torch.empty(4096, dtype=torch.uint8, device=dev)
    wake_dst = torch.empty(1 << 20, dtype=torch.uint8, device=dev)
    big = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    for _ in range(10):
        tc.copy(src)
        tc.copy(local)
        tc.copy(other)
    torch.cuda.synchronize()
    tc.collect()

    def gap(ms, case):
        end = time.perf_counter() + ms / 1000
        if case == "consumer busy":
            for _ in range(max(1, int(ms / 0.5))):  # ~0.5 ms per 1 GiB add
                big.add_(1)
        while (left := end - time.perf_counter()) > 0:
            if case == "keep-alive":
                tiny_dst.copy_(tiny)
                time.sleep(min(left, 0.002))
            else:
                time.sleep(left)
        if case == "pre-touch":
            for page in range(0, SIZE, 2 << 20):
                tiny_dst.copy_(src[page:page + 4096])
            torch.cuda.synchronize()
            time.sleep(0.001)
        elif case == "1 MiB wake":
            wake_dst.copy_(wake)
            torch.cuda.synchronize()
            time.sleep(0.001)

    def timed(t):
        s0 = tc.seconds
        tc.copy(t)
        torch.cuda.synchronize()
        tc.collect()
        return (tc.seconds - s0) * 1e6

    def show(label, ms, times):
        print(f"{label:14s} gap {ms:5.1f} ms: min {min(times):7.1f} med {statistics.median(times):7.1f} "
              f"max {max(times):7.1f} us", flush=True)

    for case in ("idle", "local", "consumer busy", "producer busy", "keep-alive", "pre-touch",
                 "1 MiB wake", "then another"):
        if case == "producer busy":
            q_out.put("busy")
            time.sleep(0.2)
        for ms in (0.5, 50):
            times, second = [], []
            for _ in range(COPIES):
                gap(ms, case)
                times.append(timed(local if case == "local" else src))
                if case == "then another":
                    second.append(timed(other))
            show(case, ms, times)
            if second:
                show("  second", ms, second)
        if case == "producer busy":
            q_out.put("quiet")
            assert q_in.get() == "quiet"
    q_out.put("stop")


if __name__ == "__main__":
    run_pair(producer, consumer)
