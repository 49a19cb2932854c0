"""``kvos bench tiers``: time to first token of later chat turns when the device pool is too
small to keep them: recompute vs loading from each configured tier."""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--system-words", type=int, default=120, help="length of the shared-per-chat system prompt")
    p.add_argument("--device-blocks", type=int, default=64, help="device pool too small to keep the chats")
    p.add_argument("--remote", default=None, help="also measure a redis:// tier")
    p.add_argument("--output", default="benchmarks/results/tiers-cpu.json")


def run_chats(llm, a) -> tuple[list[float], list[dict]]:
    """Round-robin turns across conversations so each chat's blocks are evicted between its
    turns. Returns TTFT (s) and cache sources of every turn after the first."""
    from kvos import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    first = SamplingParams(temperature=0, max_tokens=1)
    chats = [[{"role": "system", "content": f"Chat {c}. " + " ".join(f"fact{c}_{i}" for i in range(a.system_words))}]
             for c in range(a.conversations)]
    ttft, sources = [], []
    for turn in range(a.turns):
        for c, msgs in enumerate(chats):
            msgs.append({"role": "user", "content": f"Question {turn} for chat {c}?"})
            t0 = time.perf_counter()
            probe = llm.chat(msgs, first, use_tqdm=False)[0]  # prefill + first token
            dt = time.perf_counter() - t0
            answer = llm.chat(msgs, sp, use_tqdm=False)[0]
            msgs.append({"role": "assistant", "content": answer.outputs[0].text})
            if turn > 0:
                ttft.append(dt)
                sources.append(probe.metrics["cached_tokens_by_source"])
    return ttft, sources


def run(a: argparse.Namespace) -> dict:
    from kvos import LLM
    from kvos.bench.machine import machine_info

    configs = {"recompute": {}, "cpu": {"cpu_cache_gb": 2.0}}
    tmp = tempfile.mkdtemp(prefix="kvos-bench-disk-")
    configs["disk"] = {"disk_cache_dir": tmp}
    if a.remote:
        configs["remote"] = {"remote_cache": a.remote}
    results = {}
    for name, kw in configs.items():
        llm = LLM(num_blocks=a.device_blocks, **kw)
        ttft, sources = run_chats(llm, a)
        hit = sum(s.get(name, 0) for s in sources)
        results[name] = {"ttft_mean_ms": 1000 * sum(ttft) / len(ttft), "turns": len(ttft),
                         "tier_hit_tokens": hit, "device_hit_tokens": sum(s.get("device", 0) for s in sources)}
        if llm.engine.offload is not None:
            results[name]["tiers"] = llm.stats()["tiers"]
            llm.engine.offload.close()
        print(f"{name:>9}: later-turn TTFT {results[name]['ttft_mean_ms']:.1f} ms, tier hits {hit} tokens", flush=True)
    base = results["recompute"]["ttft_mean_ms"]
    result = {"machine": machine_info(), "workload": vars(a) | {"bench_run": None, "fn": None}, "results": results,
              "summary": {k: {"ttft_ms": round(v["ttft_mean_ms"], 1), "speedup_vs_recompute": round(base / v["ttft_mean_ms"], 2)}
                          for k, v in results.items()}}
    Path(a.output).parent.mkdir(parents=True, exist_ok=True)
    Path(a.output).write_text(json.dumps(result, indent=2, default=str))
    print(f"saved {a.output}")
    return result
