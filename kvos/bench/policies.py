"""``kvos bench policies``: every eviction policy against the offline optimum on the Mooncake
traces, through the simulator (the engine's own scheduler, KV manager and policy classes): hit
rate and TTFT at each pool size, with and without the eviction lookahead, as fractions of the
optimum (Belady, ties toward the chain's tail) and of the LRU-to-optimum gap closed.

With a CPU tier of ``R`` times the device's blocks (``--tier-ratios``), the device policy runs
over a tier managed by its own policy (``--tier-policies``); the optimum is then Belady on one
device pool of the device's plus the tier's blocks (no two-level policy can hold more distinct
blocks than both together, nor serve a block neither holds), and plain LRU is LRU on both.

Belady is an upper bound when requests run one at a time: run with ``--max-num-seqs 1`` (the
published figures also used ``--max-num-batched-tokens 8192``); the engine flags' defaults are
``EngineConfig``'s."""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from kvos.bench.job_pool import job_pool
from kvos.cache.eviction import online_policies
from kvos.config.flags import add_engine_args, engine_kwargs

ENGINE_FIELDS = ("max_num_batched_tokens", "max_num_seqs")
"""The ``EngineConfig`` fields of the simulated engine that the command takes."""

TRACES = {"conversation": "mooncake_conversation.jsonl.gz", "synthetic": "mooncake_synthetic.jsonl.gz"}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace-dir", default="tests/data", help="folder holding the Mooncake traces (gzipped JSONL)")
    p.add_argument("--traces", nargs="+", default=list(TRACES), choices=list(TRACES))
    p.add_argument("--limit", type=int, default=3000, help="first N requests of each trace (0: all)")
    p.add_argument("--sizes", type=int, nargs="+", default=[1000, 2000, 4000, 8000, 16000, 32000, 64000],
                   help="pool sizes in 512-token blocks")
    p.add_argument("--policies", nargs="+", default=list(online_policies()), choices=list(online_policies()))
    p.add_argument("--lookaheads", type=int, nargs="+", default=[0, 256],
                   help="eviction lookahead settings to compare (waiting requests; 0: off)")
    p.add_argument("--tier-ratios", type=float, nargs="+", default=[0, 4],
                   help="CPU-tier sizes as multiples of the device pool (0: no tier)")
    p.add_argument("--tier-policies", nargs="+", default=list(online_policies()), choices=list(online_policies()),
                   help="the tier's own policies to compare (under device LRU with the largest lookahead)")
    p.add_argument("--tier-lookaheads", type=int, nargs="+", default=[0, 1024],
                   help="the tier's lookahead settings to compare (waiting requests whose blocks it evicts last)")
    add_engine_args(p, ENGINE_FIELDS)
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    p.add_argument("--output", default="benchmarks/results/policies.json")
    p.add_argument("--plot", default="benchmarks/plots/policies_vs_optimum.png")


def _one(args: tuple) -> dict:
    trace_path, limit, size, policy, lookahead, engine, tier_blocks, tier_policy, write_policy, tier_la = args
    from kvos.sim.cost_model import CostModel
    from kvos.sim.hardware import GPUS
    from kvos.sim.shapes import PRESETS
    from kvos.sim.simulator import SimConfig, Simulator
    from kvos.sim.tier import SimTierConfig
    from kvos.sim.traces import load_mooncake

    trace = load_mooncake(trace_path)
    trace = trace[:limit] if limit else trace
    cost = CostModel.for_model(PRESETS["llama-3.1-8b"], GPUS["H100-80G"])
    tier = SimTierConfig(tier_blocks, tier_policy, write_policy, lookahead=tier_la) if tier_blocks else None
    cfg = SimConfig.of(block_size=512, num_blocks=size + (tier_blocks if policy == "belady" else 0),
                       eviction_policy=policy, eviction_lookahead=lookahead, **engine,
                       tier=None if policy == "belady" else tier)
    t = time.perf_counter()
    r = Simulator(trace, cfg, cost).run()
    return {"size": size, "policy": policy, "lookahead": lookahead, "tier_blocks": tier_blocks,
            "tier_policy": tier_policy if tier_blocks else None,
            "tier_write_policy": write_policy if tier_blocks else None,
            "tier_lookahead": tier_la if tier_blocks else None,
            "tier_token_hit_rate": r.get("tier_token_hit_rate", 0.0), "token_hit_rate": r["token_hit_rate"],
            "block_hit_rate": r["block_hit_rate"], "ttft_p50_s": r["ttft_p50_s"], "ttft_p90_s": r["ttft_p90_s"],
            "ttft_mean_s": r["ttft_mean_s"], "evictions": r["evictions"], "sim_wall_s": time.perf_counter() - t}


def run(a: argparse.Namespace) -> int:
    from kvos.bench.machine import machine_info

    jobs = []
    for name in a.traces:
        path = str(Path(a.trace_dir) / TRACES[name])
        for size in a.sizes:
            for ratio in a.tier_ratios:
                for setting in settings(a, int(ratio * size)):
                    jobs.append((name, (path, a.limit, size, *setting[:2], engine_kwargs(a, ENGINE_FIELDS), *setting[2:])))
    t0 = time.perf_counter()
    with job_pool(a.jobs) as pool:
        rows = list(pool.map(_one, [j for _, j in jobs]))
    results: dict[str, list[dict]] = {}
    for (name, _), row in zip(jobs, rows):
        results.setdefault(name, []).append(row)
    for name, rs in results.items():
        annotate(rs)
        print(table(name, rs))
    report = {"bench": "policies", "machine": machine_info(), **engine_kwargs(a, ENGINE_FIELDS), "limit": a.limit,
              "block_size": 512, "sizes": a.sizes, "wall_s": time.perf_counter() - t0,
              "summary": {name: summarize(rs) for name, rs in results.items()}, "results": results}
    out = Path(a.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    if a.plot:
        plot(results, a.sizes, Path(a.plot))
    print(f"saved {out}" + (f" and {a.plot}" if a.plot else ""))
    return report


def settings(a: argparse.Namespace, tier_blocks: int) -> list[tuple]:
    """(device policy, lookahead, tier blocks, tier policy, write policy, tier lookahead) to run
    at one size: without a tier, every device policy at every lookahead; with one, plain LRU on
    both, every device policy at the largest lookahead over a plain LRU tier, device LRU at that
    lookahead over every tier policy, write-through, then write-back, and over an LRU tier at
    each tier lookahead, write-through and write-back."""
    if not tier_blocks:
        return [("belady", 0, 0, "lru", "write_through", 0)] + [
            (p, la, 0, "lru", "write_through", 0) for p in a.policies for la in a.lookaheads]
    la = max(a.lookaheads)
    out = [("belady", 0, tier_blocks, "lru", "write_through", 0), ("lru", 0, tier_blocks, "lru", "write_through", 0)]
    out += [(p, la, tier_blocks, "lru", "write_through", 0) for p in a.policies]
    out += [("lru", la, tier_blocks, tp, "write_through", 0) for tp in a.tier_policies if tp != "lru"]
    out.append(("lru", la, tier_blocks, "lru", "write_back", 0))
    out += [("lru", la, tier_blocks, "lru", wp, tla) for tla in a.tier_lookaheads if tla
            for wp in ("write_through", "write_back")]
    return list(dict.fromkeys(out))


def label(r: dict) -> str:
    """A row's policy setting, e.g. ``lru +lookahead 256 / tier s3fifo``."""
    if r["policy"] == "belady":
        return "optimum (belady)"
    text = r["policy"] + (f" +lookahead {r['lookahead']}" if r["lookahead"] else "")
    if r["tier_blocks"]:
        text += f" / tier {r['tier_policy']}" + (" wb" if r["tier_write_policy"] == "write_back" else "")
        text += f" +lookahead {r['tier_lookahead']}" if r.get("tier_lookahead") else ""
    return text


def _ratio(r: dict) -> float:
    return round(r["tier_blocks"] / r["size"], 3)


def _groups(rows: list[dict]) -> dict[tuple[float, int], list[dict]]:
    """Rows by (tier ratio, size): each group has its own optimum and plain-LRU baseline."""
    out: dict[tuple[float, int], list[dict]] = {}
    for r in rows:
        out.setdefault((_ratio(r), r["size"]), []).append(r)
    return dict(sorted(out.items()))


def _is_plain_lru(r: dict) -> bool:
    return r["policy"] == "lru" and not r["lookahead"] and (not r["tier_blocks"] or (
        r["tier_policy"] == "lru" and r["tier_write_policy"] == "write_through" and not r.get("tier_lookahead")))


def summarize(rows: list[dict]) -> list[dict]:
    """Per tier ratio and size: the optimum, plain LRU, and the best online setting with the gap
    it closes."""
    out = []
    for (ratio, size), at in _groups(rows).items():
        opt = next(r for r in at if r["policy"] == "belady")
        lru = next((r for r in at if _is_plain_lru(r)), None)
        best = max((r for r in at if r["policy"] != "belady"), key=lambda r: r["token_hit_rate"])
        out.append({"size": size, "tier_ratio": ratio, "optimum": round(opt["token_hit_rate"], 4),
                    "lru": None if lru is None else round(lru["token_hit_rate"], 4),
                    "best": label(best), "best_hit": round(best["token_hit_rate"], 4),
                    "gap_closed": None if best["gap_closed"] is None else round(best["gap_closed"], 3)})
    return out


def annotate(rows: list[dict]) -> None:
    """Add each row's fraction of the optimum and of the LRU-to-optimum gap it closes (against
    plain LRU at the same size and tier ratio)."""
    for at in _groups(rows).values():
        best = next(r for r in at if r["policy"] == "belady")["token_hit_rate"]
        base = next((r["token_hit_rate"] for r in at if _is_plain_lru(r)), None)
        for r in at:
            r["of_optimum"] = r["token_hit_rate"] / best if best else None
            r["gap_closed"] = ((r["token_hit_rate"] - base) / (best - base)
                               if base is not None and best - base > 1e-9 else None)


def table(name: str, rows: list[dict]) -> str:
    """One block per tier ratio: a row per setting, a column per size."""
    lines = []
    for ratio in sorted({_ratio(r) for r in rows}):
        at = [r for r in rows if _ratio(r) == ratio]
        sizes = sorted({r["size"] for r in at})
        by = {(label(r), r["size"]): r for r in at}
        head = "no tier" if not ratio else f"a CPU tier of {ratio:g}x the device's blocks"
        lines += [f"\n{name}, {head}: prompt-token hit rate (fraction of the optimum)",
                  f"{'setting':<34}" + "".join(f"{s:>16,}" for s in sizes)]
        for text in dict.fromkeys(label(r) for r in sorted(at, key=lambda r: r["policy"] != "belady")):
            cells = []
            for s in sizes:
                r = by.get((text, s))
                cells.append("-" if r is None else f"{r['token_hit_rate']:.1%}" if r["policy"] == "belady"
                             else f"{r['token_hit_rate']:.1%} ({r['of_optimum']:.2f})")
            lines.append(f"{text:<34}" + "".join(f"{c:>16}" for c in cells))
    return "\n".join(lines)


def plot(results: dict, sizes: list[int], path: Path) -> None:
    """A panel per trace (columns) and tier ratio (rows): hit rate against pool size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ratios = sorted({_ratio(r) for rows in results.values() for r in rows})
    fig, axes = plt.subplots(len(ratios), len(results), figsize=(6.5 * len(results), 4.5 * len(ratios)),
                             squeeze=False)
    for col, (name, rows) in enumerate(results.items()):
        for row, ratio in enumerate(ratios):
            ax = axes[row][col]
            series: dict[str, list] = {}
            for r in sorted((r for r in rows if _ratio(r) == ratio), key=lambda r: r["size"]):
                series.setdefault(label(r), []).append((r["size"], r["token_hit_rate"]))
            for i, (text, pts) in enumerate(series.items()):
                optimum = text.startswith("optimum")
                ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], "--" if optimum else "-",
                        color="k" if optimum else f"C{i % 10}", marker="o", ms=3, label=text)
            ax.set_xscale("log")
            ax.set_xlabel("device pool size (512-token blocks)")
            ax.set_ylabel("prompt tokens served from cache (%)")
            ax.set_title(f"Mooncake {name} trace, " + ("no tier" if not ratio else f"CPU tier {ratio:g}x"))
            ax.grid(alpha=0.3)
            ax.legend(fontsize=6, ncol=2)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
