"""``kvos bench tier-bandwidth``: how fast blocks loaded from a CPU tier land in device blocks,
through the engine's own load path, as a fraction of a plain page-locked host-to-device copy on the
same machine; how fast write-through stores them (the first store, then warm ones); and the
host's checksum rate, which bounds loads verified on the host."""
from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cuda")
    p.add_argument("--layers", type=int, default=32, help="Llama-3.1-8B shape by default")
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--blocks", type=int, default=256, help="blocks per load")
    p.add_argument("--repeats", type=int, default=5, help="timed loads (after one warm-up)")
    p.add_argument("--verify-threads", type=int, default=None,
                   help="checksum threads of a load (default: the engine's, min(8, cores / 2))")
    p.add_argument("--verify", choices=["auto", "host", "device"], default="auto",
                   help="where loads are checked (the engine's tier_verify; auto: device on a GPU)")
    p.add_argument("--phases", action="store_true",
                   help="on a GPU, also profile one more load and report where its time goes on the device")
    p.add_argument("--output", default="benchmarks/results/tier-bandwidth.json")


def run(a: argparse.Namespace) -> dict:
    import torch

    from kvos.bench.machine import machine_info
    from kvos.cache.tiers import CPUTier, TierHierarchy, allocate_bytearray
    from kvos.cache.tiers.codec import checksum
    from kvos.connector.host_memory import PageLockedAllocator
    from kvos.connector.tier_io import TierIO, host_digest
    from kvos.worker.runner import ModelRunner

    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    device_verify = a.verify == "device" or (a.verify == "auto" and cuda)
    runner = ModelRunner.__new__(ModelRunner)  # only the KV tensor and its block copies are needed
    runner.device, runner.dtype = dev, torch.bfloat16
    kv = torch.zeros(a.blocks + 1, a.layers, 2, a.block_size, a.kv_heads, a.head_dim, dtype=torch.bfloat16,
                     device=dev)
    runner.group_caches = [kv.normal_()]  # one cache group, page-major
    runner.group_pages = [kv.view(a.blocks + 1, -1).view(torch.uint8)]
    expected = kv[1:].clone()
    bb = runner.block_bytes
    tier = CPUTier(2 * (bb + 128) * (a.blocks + 8), PageLockedAllocator() if cuda else allocate_bytearray,
                   digest_fn=host_digest if device_verify else None)
    tier_io = TierIO(TierHierarchy([tier]), runner, a.verify_threads)
    ids = list(range(1, a.blocks + 1))
    total = bb * a.blocks

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(dev)

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvos-tier-io") as io:
        # store path, as write-through runs it (``TierIO.store_computed`` on the I/O thread):
        # device-to-host copies straight into CPU-tier slots, digests computed on the device;
        # timed until the blocks are stored. Each round stores new keys (a warm round evicts
        # older ones, as a full tier does)
        stores = []
        for r in range(a.repeats + 1):
            keys = [(r << 32 | b).to_bytes(16, "little") for b in ids]
            sync()
            t0 = time.perf_counter()
            after = None
            if cuda:
                after = torch.cuda.Event()
                after.record()
            io.submit(tier_io.store_computed, keys, ids, after).result()
            stores.append(time.perf_counter() - t0)
        kv[1:].zero_()
        # load path, as a LOADING request runs it: fetch on the I/O thread, install on this one
        def load() -> None:
            loaded = io.submit(tier_io.fetch, keys).result()
            tier_io.install(loaded, ids)
            sync()
            assert loaded.sources == ["cpu"] * a.blocks

        times = []
        for _ in range(a.repeats + 1):
            sync()
            t0 = time.perf_counter()
            load()
            times.append(time.perf_counter() - t0)
        phases = None
        if a.phases and cuda:
            from kvos.bench.device_timeline import device_timeline

            sync()
            phases = device_timeline(load)
    tier_io.close()
    load_s = sum(times[1:]) / a.repeats
    warm_store_s = sum(stores[1:]) / a.repeats
    views = [tier.get(k) for k in keys]
    t0 = time.perf_counter()  # one thread
    for v in views:
        checksum(v)
    checksum_s = time.perf_counter() - t0
    result = {"machine": machine_info(), "device": str(dev), "block_bytes": bb, "blocks": a.blocks,
              "pinned_tier": bool(cuda), "verify": "device" if device_verify else "host",
              "verify_threads": tier_io.verify_threads,
              "tier_load_GBps": total / load_s / 1e9,
              "tier_load_ms": load_s * 1e3, "store_cold_GBps": total / stores[0] / 1e9,
              "store_warm_GBps": total / warm_store_s / 1e9,
              "checksum_GBps": total / checksum_s / 1e9,
              "verified": bool(torch.equal(kv[1:], expected))}
    if cuda:
        host = torch.empty(total, dtype=torch.uint8, pin_memory=True)
        dst = torch.empty(total, dtype=torch.uint8, device=dev)
        dst.copy_(host, non_blocking=True)
        sync()
        t0 = time.perf_counter()
        for _ in range(5):
            dst.copy_(host, non_blocking=True)
        sync()
        result["pinned_h2d_GBps"] = 5 * total / (time.perf_counter() - t0) / 1e9
        rows, blocks = dst.view(a.blocks, bb), host.view(a.blocks, bb)  # the same bytes, one copy per block
        sync()
        t0 = time.perf_counter()
        for _ in range(5):
            for i in range(a.blocks):
                rows[i].copy_(blocks[i], non_blocking=True)
        sync()
        result["pinned_h2d_per_block_GBps"] = 5 * total / (time.perf_counter() - t0) / 1e9
        result["fraction_of_pinned_h2d"] = result["tier_load_GBps"] / result["pinned_h2d_GBps"]
        sync()
        t0 = time.perf_counter()
        for _ in range(5):
            host.copy_(dst, non_blocking=True)
        sync()
        result["pinned_d2h_GBps"] = 5 * total / (time.perf_counter() - t0) / 1e9
        result["store_warm_fraction_of_pinned_d2h"] = result["store_warm_GBps"] / result["pinned_d2h_GBps"]
    if phases is not None:
        result["load_phases_profiled"] = phases
    result["summary"] = {k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()
                         if isinstance(v, (float, bool)) or k == "verify_threads"}
    Path(a.output).parent.mkdir(parents=True, exist_ok=True)
    Path(a.output).write_text(json.dumps(result, indent=2))
    print(f"saved {a.output}")
    return result
