"""Probe: moving KV rows from a peer GPU (CUDA IPC memory) into a pool, per hand-over size:
(a) copy engine into a new buffer, then a local scatter; (b) one scatter kernel reading the
peer's memory straight into the pool (64-bit words); (c) the same in 128-bit words. Events
around each on a side stream behind a spin, so they hold the device work alone."""
from ipc_pair import as_consumer, as_producer, open_shared, run_pair

ROW = 2 << 20
COUNTS = [1, 4, 10, 32, 128]


def producer(q_out, q_in):
    as_producer()
    import torch
    from torch.multiprocessing.reductions import reduce_tensor
    bufs = [torch.randint(0, 255, (n, ROW), dtype=torch.uint8, device="cuda") for n in COUNTS]
    torch.cuda.synchronize()
    q_out.put([reduce_tensor(b) for b in bufs])
    q_in.get()


def consumer(q_in, q_out):
    as_consumer()
    import torch
    srcs = open_shared(q_in.get())
    dev = torch.device("cuda:0")
    pool = torch.zeros(2048, ROW, dtype=torch.uint8, device=dev)
    side = torch.cuda.Stream(dev)
    big = torch.empty(4 << 30, dtype=torch.uint8, device=dev)

    def timed(fn, reps=20, busy=False):
        total = 0.0
        for _ in range(reps):
            torch.cuda.synchronize()
            if busy:
                for _ in range(3):
                    big.add_(1)
            with torch.cuda.stream(side):
                torch.cuda._sleep(200_000)
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record(); fn(); e.record()
            torch.cuda.synchronize()
            total += s.elapsed_time(e) / 1e3
        return total / reps

    for busy in (False, True):
        for n, src in zip(COUNTS, srcs):
            ids = torch.randperm(2048, device=dev)[:n]
            nb = n * ROW
            def a():
                tmp = torch.empty_like(src); tmp.copy_(src)
                pool.view(torch.int64).index_copy_(0, ids, tmp.view(torch.int64))
            def a_copy():
                torch.empty_like(src).copy_(src)
            def b():
                pool.view(torch.int64).index_copy_(0, ids, src.view(torch.int64))
            def c():
                pool[ids] = src
            for name, fn in [("copy engine only", a_copy), ("copy engine + scatter", a),
                             ("scatter from peer, int64", b), ("index_put from peer, uint8", c)]:
                t = timed(fn, busy=busy)
                print(f"{'busy' if busy else 'idle'} {n:4d} rows {nb >> 20:4d} MiB {name:28s} {t * 1e6:8.1f} us {nb / t / 1e9:6.1f} GB/s", flush=True)
            tmp = torch.empty_like(src); tmp.copy_(src)
            b(); torch.cuda.synchronize()
            assert torch.equal(pool[ids].cpu(), src.cpu())
    q_out.put("stop")


if __name__ == "__main__":
    run_pair(producer, consumer)
