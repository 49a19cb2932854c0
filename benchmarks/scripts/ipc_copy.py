"""Microbenchmark: KV rows shared by CUDA IPC from a process on GPU A, copied by a process on
GPU B. Variants: (a) opened under B's own device index (how kvos does it now); (b) opened under
the index B's process gives GPU A (a real cross-device tensor) then copy_; (c) B's own
cross-device copy (baseline)."""
import multiprocessing as mp
import os


def producer(q_out, q_in, sizes):
    os.environ["CUDA_VISIBLE_DEVICES"] = "1,0"
    import torch
    from torch.multiprocessing.reductions import reduce_tensor
    bufs = [torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda") for n in sizes]
    torch.cuda.synchronize()
    uuid = str(torch.cuda.get_device_properties(0).uuid)
    q_out.put((uuid, [reduce_tensor(b) for b in bufs]))
    q_in.get()


def timeit(fn, reps=20):
    import torch
    fn(); torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        fn()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / reps / 1e3


def consumer(q_in, q_out, sizes):
    os.environ["CUDA_VISIBLE_DEVICES"] = "0,1"
    import torch
    uuid, shared = q_in.get()
    idx = [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())].index(uuid)
    print("producer GPU is index", idx, "here; peer access", torch.cuda.can_device_access_peer(0, idx), flush=True)
    half = len(shared) // 2
    for n, (rebuild, args), (rebuild_b, args_b) in zip(sizes, shared[:half], shared[half:]):
        a = rebuild(*args)  # labelled with the producer's index (0): this process's own GPU
        local = torch.empty(n, dtype=torch.uint8, device="cuda:0")
        t = timeit(lambda: local.copy_(a))
        ok = torch.equal(local.cpu(), a.cpu()) if n < (64 << 20) else None
        print(f"(a) own-index open, {n >> 20} MiB: {n / t / 1e9:.1f} GB/s equal={ok}", flush=True)
        args_b = list(args_b); args_b[6] = idx
        try:
            b = rebuild_b(*args_b)
            print("   (b) tensor device", b.device, flush=True)
            t = timeit(lambda: local.copy_(b))
            ok = torch.equal(local.cpu(), b.cpu()) if n < (64 << 20) else None
            print(f"(b) peer-index open, {n >> 20} MiB: {n / t / 1e9:.1f} GB/s equal={ok}", flush=True)
        except Exception as err:
            print("(b) failed:", repr(err), flush=True)
        src = torch.empty(n, dtype=torch.uint8, device=f"cuda:{idx}")
        t = timeit(lambda: local.copy_(src))
        print(f"(c) own cross-device copy, {n >> 20} MiB: {n / t / 1e9:.1f} GB/s", flush=True)
        # scatter of rows into a pool by index, after a local copy
        rows = n // (2 << 20)
        if rows:
            pool = torch.empty(512, 2 << 20, dtype=torch.uint8, device="cuda:0")
            ids = torch.randperm(512, device="cuda:0")[:rows]
            lv = local[: rows * (2 << 20)].view(rows, 2 << 20)
            t = timeit(lambda: pool.index_copy_(0, ids, lv))
            print(f"    index_copy_ of {rows} rows locally: {rows * (2 << 20) / t / 1e9:.1f} GB/s", flush=True)
            av = a[: rows * (2 << 20)].view(rows, 2 << 20)
            t = timeit(lambda: pool.index_copy_(0, ids, av))
            print(f"    index_copy_ of {rows} rows straight from (a): {rows * (2 << 20) / t / 1e9:.1f} GB/s", flush=True)
    q_out.put("done")


if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    sizes = [19 << 20, 190 << 20]
    a, b = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=producer, args=(a, b, sizes + sizes)); p.start()
    c = ctx.Process(target=consumer, args=(a, b, sizes)); c.start()
    c.join(120); p.join(30)
