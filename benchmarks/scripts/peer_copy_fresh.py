"""Probe: copy-engine reads of CUDA IPC memory, the same mapping again and again (warm) against
a freshly opened handle per copy (as each prefill->decode hand-over opens one now)."""
from ipc_pair import as_consumer, as_producer, run_pair

SIZES = [20 << 20, 400 << 20]
FRESH = 12


def producer(q_out, q_in):
    as_producer()
    import torch
    from torch.multiprocessing.reductions import reduce_tensor
    for n in SIZES:
        bufs = [torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda") for _ in range(FRESH)]
        torch.cuda.synchronize()
        q_out.put([reduce_tensor(b) for b in bufs])
        q_in.get()


def consumer(q_in, q_out):
    as_consumer()
    import time

    import torch

    from kvos.worker.timed_copies import TimedCopies
    tc = TimedCopies(torch.device("cuda:0"))
    for n in SIZES:
        shared = q_in.get()
        opened = []
        s0 = tc.seconds; t_open = 0.0
        for rebuild, args in shared:  # fresh: open, copy once
            t = time.perf_counter(); src = rebuild(*args); t_open += time.perf_counter() - t
            tc.copy(src); torch.cuda.synchronize(); tc.collect(); opened.append(src)
        fresh = (tc.seconds - s0) / FRESH
        s0 = tc.seconds
        for _ in range(FRESH):  # warm: the last mapping again
            tc.copy(opened[-1]); torch.cuda.synchronize(); tc.collect()
        warm = (tc.seconds - s0) / FRESH
        s0 = tc.seconds
        for src in opened:  # each mapping a second time
            tc.copy(src); torch.cuda.synchronize(); tc.collect()
        second = (tc.seconds - s0) / FRESH
        print(f"{n >> 20} MiB: first copy of a fresh mapping {fresh * 1e6:.1f} us ({n / fresh / 1e9:.1f} GB/s); "
              f"second {second * 1e6:.1f} us ({n / second / 1e9:.1f} GB/s); warm {warm * 1e6:.1f} us "
              f"({n / warm / 1e9:.1f} GB/s); open {t_open / FRESH * 1e3:.2f} ms", flush=True)
        del opened, src
        q_out.put("next")


if __name__ == "__main__":
    run_pair(producer, consumer)
