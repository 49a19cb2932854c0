"""``kvos bench tier-bandwidth``: how fast blocks loaded from a CPU tier land in device blocks,
as a fraction of a plain pinned host-to-device copy on the same machine."""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cuda")
    p.add_argument("--layers", type=int, default=32, help="Llama-3.1-8B shape by default")
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--blocks", type=int, default=256)
    p.add_argument("--output", default="benchmarks/results/tier-bandwidth.json")


def run(a: argparse.Namespace) -> dict:
    import torch

    from kvos.bench.machine import machine_info
    from kvos.cache.tiers import CPUTier
    from kvos.model.runner import ModelRunner

    dev = torch.device(a.device)
    runner = ModelRunner.__new__(ModelRunner)  # only the KV tensor and its block copies are needed
    runner.device, runner.dtype = dev, torch.bfloat16
    runner.kv_caches = torch.zeros(a.layers, 2, a.blocks + 1, a.block_size, a.kv_heads, a.head_dim,
                                   dtype=torch.bfloat16, device=dev)
    runner.kv_caches.normal_()
    block_bytes = runner.kv_caches[:, :, 0].numel() * 2
    tier = CPUTier(block_bytes * (a.blocks + 8) * 2)
    for b in range(1, a.blocks + 1):
        tier.put(b.to_bytes(16, "little"), runner.read_block(b))

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    sync()
    t0 = time.perf_counter()
    for b in range(1, a.blocks + 1):
        runner.write_block(b, tier.get(b.to_bytes(16, "little")))
    sync()
    tier_s = time.perf_counter() - t0
    total = block_bytes * a.blocks
    result = {"machine": machine_info(), "block_bytes": block_bytes, "blocks": a.blocks,
              "tier_load_GBps": total / tier_s / 1e9}
    if dev.type == "cuda":
        host = torch.empty(total, dtype=torch.uint8).pin_memory()
        dst = torch.empty(total, dtype=torch.uint8, device=dev)
        dst.copy_(host, non_blocking=True)
        sync()
        t0 = time.perf_counter()
        for _ in range(5):
            dst.copy_(host, non_blocking=True)
        sync()
        result["pinned_h2d_GBps"] = 5 * total / (time.perf_counter() - t0) / 1e9
        result["fraction_of_pinned_h2d"] = result["tier_load_GBps"] / result["pinned_h2d_GBps"]
    result["summary"] = {k: round(v, 3) for k, v in result.items() if isinstance(v, float)}
    Path(a.output).parent.mkdir(parents=True, exist_ok=True)
    Path(a.output).write_text(json.dumps(result, indent=2))
    print(f"saved {a.output}")
    return result
