"""``kvos bench policies``: every eviction policy against the offline optimum on the Mooncake
traces, through the simulator (the engine's own scheduler, KV manager and policy classes): hit
rate and TTFT at each pool size, with and without the eviction lookahead, as fractions of the
optimum (Belady, ties toward the chain's tail) and of the LRU-to-optimum gap closed."""
from __future__ import annotations

import argparse
import json
import os
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from kvos.cache.eviction import POLICIES

TRACES = {"conversation": "mooncake_conversation.jsonl.gz", "synthetic": "mooncake_synthetic.jsonl.gz"}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace-dir", default="tests/data", help="folder holding the Mooncake traces (gzipped JSONL)")
    p.add_argument("--traces", nargs="+", default=list(TRACES), choices=list(TRACES))
    p.add_argument("--limit", type=int, default=3000, help="first N requests of each trace (0: all)")
    p.add_argument("--sizes", type=int, nargs="+", default=[1000, 2000, 4000, 8000, 16000, 32000, 64000],
                   help="pool sizes in 512-token blocks")
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    p.add_argument("--lookaheads", type=int, nargs="+", default=[0, 256],
                   help="eviction lookahead settings to compare (waiting requests; 0: off)")
    p.add_argument("--max-num-seqs", type=int, default=1, help="1: one request at a time, as the issue's setup")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    p.add_argument("--output", default="benchmarks/results/policies.json")
    p.add_argument("--plot", default="benchmarks/plots/policies_vs_optimum.png")


def _one(args: tuple) -> dict:
    trace_path, limit, size, policy, lookahead, max_num_seqs = args
    from kvos.sim.cost_model import CostModel
    from kvos.sim.hardware import GPUS
    from kvos.sim.shapes import PRESETS
    from kvos.sim.simulator import SimConfig, Simulator
    from kvos.sim.traces import load_mooncake

    trace = load_mooncake(trace_path)
    trace = trace[:limit] if limit else trace
    cost = CostModel.for_model(PRESETS["llama-3.1-8b"], GPUS["H100-80G"])
    cfg = SimConfig(block_size=512, num_blocks=size, eviction_policy=policy, max_num_seqs=max_num_seqs,
                    eviction_lookahead=lookahead)
    t = time.perf_counter()
    r = Simulator(trace, cfg, cost).run()
    return {"size": size, "policy": policy, "lookahead": lookahead, "token_hit_rate": r["token_hit_rate"],
            "block_hit_rate": r["block_hit_rate"], "ttft_p50_s": r["ttft_p50_s"], "ttft_p90_s": r["ttft_p90_s"],
            "ttft_mean_s": r["ttft_mean_s"], "evictions": r["evictions"], "sim_wall_s": time.perf_counter() - t}


def run(a: argparse.Namespace) -> int:
    from kvos.bench.machine import machine_info

    jobs = []
    for name in a.traces:
        path = str(Path(a.trace_dir) / TRACES[name])
        for size in a.sizes:
            jobs.append((name, (path, a.limit, size, "belady", 0, a.max_num_seqs)))
            for policy in a.policies:
                for lookahead in a.lookaheads:
                    jobs.append((name, (path, a.limit, size, policy, lookahead, a.max_num_seqs)))
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=max(1, a.jobs)) as pool:
        rows = list(pool.map(_one, [j for _, j in jobs]))
    results: dict[str, list[dict]] = {}
    for (name, _), row in zip(jobs, rows):
        results.setdefault(name, []).append(row)
    for name, rs in results.items():
        annotate(rs)
        print(table(name, rs, a.lookaheads))
    report = {"bench": "policies", "machine": machine_info(), "max_num_seqs": a.max_num_seqs, "limit": a.limit,
              "block_size": 512, "sizes": a.sizes, "wall_s": time.perf_counter() - t0,
              "summary": {name: summarize(rs) for name, rs in results.items()}, "results": results}
    out = Path(a.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    if a.plot:
        plot(results, a.sizes, Path(a.plot))
    print(f"saved {out}" + (f" and {a.plot}" if a.plot else ""))
    return report


def summarize(rows: list[dict]) -> list[dict]:
    """Per size: the optimum, plain LRU, and the best online setting with the gap it closes."""
    out = []
    for size in sorted({r["size"] for r in rows}):
        at = [r for r in rows if r["size"] == size]
        opt = next(r for r in at if r["policy"] == "belady")
        lru = next((r for r in at if r["policy"] == "lru" and r["lookahead"] == 0), None)
        best = max((r for r in at if r["policy"] != "belady"), key=lambda r: r["token_hit_rate"])
        out.append({"size": size, "optimum": round(opt["token_hit_rate"], 4),
                    "lru": None if lru is None else round(lru["token_hit_rate"], 4),
                    "best": f"{best['policy']}" + (f"+lookahead{best['lookahead']}" if best["lookahead"] else ""),
                    "best_hit": round(best["token_hit_rate"], 4),
                    "gap_closed": None if best["gap_closed"] is None else round(best["gap_closed"], 3)})
    return out


def annotate(rows: list[dict]) -> None:
    """Add each row's fraction of the optimum and of the LRU-to-optimum gap it closes (against
    plain LRU, lookahead off, at the same size)."""
    opt = {r["size"]: r["token_hit_rate"] for r in rows if r["policy"] == "belady"}
    lru = {r["size"]: r["token_hit_rate"] for r in rows if r["policy"] == "lru" and r["lookahead"] == 0}
    for r in rows:
        best, base = opt[r["size"]], lru.get(r["size"])
        r["of_optimum"] = r["token_hit_rate"] / best if best else None
        r["gap_closed"] = ((r["token_hit_rate"] - base) / (best - base)
                           if base is not None and best - base > 1e-9 else None)


def table(name: str, rows: list[dict], lookaheads: list[int]) -> str:
    sizes = sorted({r["size"] for r in rows})
    by = {(r["policy"], r["lookahead"], r["size"]): r for r in rows}
    lines = [f"\n{name}: prompt-token hit rate (fraction of the optimum)",
             f"{'policy':<22}" + "".join(f"{s:>16,}" for s in sizes)]
    lines.append(f"{'optimum (belady)':<22}" + "".join(f"{by[('belady', 0, s)]['token_hit_rate']:>16.1%}"
                                                      for s in sizes))
    for policy in [p for p in POLICIES if any(k[0] == p for k in by)]:
        for la in lookaheads:
            label = policy + (f" +lookahead {la}" if la else "")
            cells = []
            for s in sizes:
                r = by.get((policy, la, s))
                cells.append(f"{r['token_hit_rate']:>8.1%} ({r['of_optimum']:.2f})" if r else f"{'-':>16}")
            lines.append(f"{label:<22}" + "".join(f"{c:>16}" for c in cells))
    return "\n".join(lines)


def plot(results: dict, sizes: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6.5 * len(results), 4.5), squeeze=False)
    for ax, (name, rows) in zip(axes[0], results.items()):
        series: dict[str, list] = {}
        for r in sorted(rows, key=lambda r: r["size"]):
            label = "optimum" if r["policy"] == "belady" else r["policy"] + (" +lookahead" if r["lookahead"] else "")
            series.setdefault(label, []).append((r["size"], r["token_hit_rate"]))
        colors = {p: f"C{i}" for i, p in enumerate(POLICIES)}
        for label, pts in series.items():
            policy = label.split(" ")[0]
            color = "k" if label == "optimum" else colors[policy]
            style = "--" if label == "optimum" else ("-" if "lookahead" in label else ":")
            ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], style, color=color, marker="o", ms=3,
                    label=label)
        ax.set_xscale("log")
        ax.set_xlabel("pool size (512-token blocks)")
        ax.set_ylabel("prompt tokens served from cache (%)")
        ax.set_title(f"Mooncake {name} trace")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7, ncol=2)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
