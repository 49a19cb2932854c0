"""Probe: per-copy device time of TimedCopies (the decode engine's peer copies) for a range of
sizes, with the copying GPU idle, busy with memory-bound work, or busy with matrix products on
its main stream, and with the source GPU busy or not. Prints a fit time = a + bytes / bw."""
import time

from ipc_pair import as_consumer, as_producer, open_shared, run_pair

SIZES = [2 << 20, 8 << 20, 19 << 20, 64 << 20, 256 << 20]


def producer(q_out, q_in):
    as_producer()
    import torch
    from torch.multiprocessing.reductions import reduce_tensor
    bufs = [torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda") for n in SIZES]
    torch.cuda.synchronize()
    q_out.put([reduce_tensor(b) for b in bufs])
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    while True:
        msg = q_in.get()
        if msg == "stop":
            break
        if msg == "busy":  # queue about 2.5 s of matrix products
            for _ in range(1500):
                a @ a
            torch.cuda.synchronize()
            q_out.put("idle")


def consumer(q_in, q_out):
    as_consumer()
    import torch

    from kvos.worker.timed_copies import TimedCopies
    srcs = open_shared(q_in.get())
    dev = torch.device("cuda:0")
    tc = TimedCopies(dev)
    big = torch.empty(4 << 30, dtype=torch.uint8, device=dev)
    m = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)

    pinned = [torch.empty(4096, dtype=torch.int64).pin_memory() for _ in range(8)]
    back = [torch.empty(64, dtype=torch.int64).pin_memory() for _ in range(8)]
    small = torch.zeros(64, dtype=torch.int64, device=dev)

    def background(kind):
        if kind == "copies":  # like a step's inputs and outputs: small pinned copies both ways
            for i in range(200):
                pinned[i % 8].to(dev, non_blocking=True)
                small.add_(1)
                back[i % 8].copy_(small, non_blocking=True)
        elif kind == "mem":
            for _ in range(120):
                big.add_(1)
        elif kind == "mm":
            for _ in range(120):
                m @ m

    def run(kind, label):
        rows = []
        for n, src in zip(SIZES, srcs):
            torch.cuda.synchronize()
            tc.collect()
            s0, b0 = tc.seconds, tc.copies
            background(kind)
            for _ in range(20):
                if kind == "copies":
                    background(kind)  # queued just ahead of each copy, so they overlap
                tc.copy(src)
                time.sleep(0.0005)
            torch.cuda.synchronize()
            tc.collect()
            per = (tc.seconds - s0) / (tc.copies - b0)
            rows.append((n, per))
            print(f"{label:28s} {n >> 20:4d} MiB: {per * 1e6:8.1f} us  {n / per / 1e9:6.1f} GB/s", flush=True)
        (n1, t1), (n2, t2) = rows[0], rows[-1]
        bw = (n2 - n1) / (t2 - t1)
        print(f"{label:28s} fit: a = {(t1 - n1 / bw) * 1e6:.1f} us, bw = {bw / 1e9:.1f} GB/s", flush=True)

    for kind in ["idle", "copies", "mem", "mm"]:
        run(kind, f"B {kind}, A idle")
    tc.LEAD_CYCLES = 0
    run("idle", "B idle, A idle, no lead")
    tc.LEAD_CYCLES = TimedCopies.LEAD_CYCLES
    q_out.put("busy")
    run("mem", "B mem, A matmul")
    q_in.get()
    ref = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(10):
        ref.copy_(srcs[-1])
    torch.cuda.synchronize()
    print(f"torch copy_ 256 MiB x10: {10 * (256 << 20) / (time.perf_counter() - t) / 1e9:.1f} GB/s", flush=True)
    q_out.put("stop")


if __name__ == "__main__":
    run_pair(producer, consumer)
