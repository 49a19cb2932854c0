"""Small all-reduces as tensor parallelism's decode steps issue them (hidden 8,192 in bf16: 16 KB
at batch 1, 1 MB at batch 64), one rank per GPU, each way timed as 32 calls back to back in a
CUDA graph (the way ``kvos bench tensor-parallel`` times NCCL's): NCCL as kvos calls it
(``dist.all_reduce``), NCCL on buffers registered as symmetric windows (NCCL >= 2.27 then picks
its low-latency kernels), and PyTorch symmetric memory's one-shot and two-shot kernels (what vLLM
and SGLang use for small messages). Each result is checked against the exact sum first. Needs
2+ GPUs of one host with peer access; symmetric memory refuses two ranks on one GPU. Prints one
JSON line per way and size.

    python benchmarks/scripts/allreduce_latency.py            # every GPU of the host; WORLD=4 for fewer
"""
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HIDDEN = 8192
BATCHES = (1, 8, 64, 256)
CALLS = 32


def graph_us(fn) -> float:
    """Median microseconds per call of ``fn`` over CALLS calls in one CUDA graph."""
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn()
    times = []
    for _ in range(10):
        dist.barrier()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / CALLS)
    return sorted(times)[len(times) // 2]


def ways(rank: int, world: int, device: torch.device):
    """(name, make) pairs: make(numel) returns (input tensor to fill, call, output tensor)."""
    group = dist.group.WORLD

    def nccl(n):
        x = torch.empty(n, dtype=torch.bfloat16, device=device)
        return x, lambda: dist.all_reduce(x, group=group), x
    yield "nccl", nccl

    try:
        backend = dist.get_backend_impl(group, device) if hasattr(dist, "get_backend_impl") else \
            group._get_backend(device)
        pool = torch.cuda.MemPool(backend.mem_allocator)
        backend.register_mem_pool(pool, symm=True)

        def nccl_symmetric(n):
            with torch.cuda.use_mem_pool(pool):
                x = torch.empty(n, dtype=torch.bfloat16, device=device)
            return x, lambda: dist.all_reduce(x, group=group), x
        yield "nccl_symmetric_window", nccl_symmetric
    except Exception as e:  # noqa: BLE001 - the probe reports what this torch / NCCL lacks
        yield "nccl_symmetric_window", repr(e)

    try:
        import torch.distributed._symmetric_memory as symm_mem

        buf = symm_mem.empty(HIDDEN * max(BATCHES), dtype=torch.bfloat16, device=device)
        symm_mem.rendezvous(buf, group.group_name)

        def one_shot(n):
            out = torch.empty(n, dtype=torch.bfloat16, device=device)
            view = buf[:n]
            return view, lambda: torch.ops.symm_mem.one_shot_all_reduce_out(view, "sum", group.group_name, out), out

        def two_shot(n):
            view = buf[:n]
            return view, lambda: torch.ops.symm_mem.two_shot_all_reduce_(view, "sum", group.group_name), view
        yield "symm_mem_one_shot", one_shot
        yield "symm_mem_two_shot", two_shot
    except Exception as e:  # noqa: BLE001
        yield "symm_mem", repr(e)


def run(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    for name, make in ways(rank, world, device):
        if isinstance(make, str):
            if rank == 0:
                print(json.dumps({"way": name, "world": world, "error": make}), flush=True)
            continue
        for batch in BATCHES:
            n = batch * HIDDEN
            try:
                inp, call, out = make(n)
                inp.copy_(torch.arange(n, device=device, dtype=torch.float32).remainder(7).add(rank).bfloat16())
                call()
                torch.cuda.synchronize()
                want = torch.arange(n, device=device, dtype=torch.float32).remainder(7) * world + sum(range(world))
                ok = bool(torch.equal(out.float(), want))
                us = graph_us(call)
                row = {"way": name, "world": world, "batch": batch, "bytes": n * 2, "us": round(us, 2), "exact": ok}
            except Exception as e:  # noqa: BLE001
                row = {"way": name, "world": world, "batch": batch, "error": repr(e)[:300]}
            if rank == 0:
                print(json.dumps(row), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    world = int(os.environ.get("WORLD", torch.cuda.device_count()))
    if world < 2:
        sys.exit("needs two or more GPUs")
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "nccl": ".".join(map(str, torch.cuda.nccl.version()))}), flush=True)
    mp.spawn(run, args=(world, 29541), nprocs=world)
