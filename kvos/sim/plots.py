"""PNG plots of simulator sweeps (matplotlib, headless)."""
from __future__ import annotations

from pathlib import Path


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_hit_rate_vs_size(results: dict[str, list[dict]], sizes: list[int], block_size: int, path: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    tokens = [s * block_size for s in sizes]
    for policy, rs in results.items():
        ax.plot(tokens, [r["token_hit_rate"] * 100 for r in rs], marker="o", label=policy)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("cache size (tokens)")
    ax.set_ylabel("prefix-cache token hit rate (%)")
    ax.set_title("Hit rate vs cache size by eviction policy")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_ttft_cdf(results: dict[str, list[dict]], path: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy, rs in results.items():
        for r in (rs[0], rs[-1]):
            xs = sorted(r["ttft_s"])
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            ax.plot(xs, ys, label=f"{policy}, {r['num_blocks']} blocks")
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT CDF (smallest and largest cache)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_routing(rows: list[dict], references: tuple[str, ...], path: Path, title: str) -> Path:
    """Two panels against the fleet size: block hit rate per row label (the one-engine references
    in black, dashed and dotted) and p90 TTFT per router (the references left out: their compute
    differs from the fleet's)."""
    plt = _plt()
    fig, (hit_ax, ttft_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    routers = list(dict.fromkeys(r["label"] for r in rows))
    for i, name in enumerate(routers):
        pts = sorted(((r["engines"], r) for r in rows if r["label"] == name), key=lambda p: p[0])
        ns = [n for n, _ in pts]
        ref = name in references
        style = dict(color="k", ls=("--", ":")[references.index(name) % 2]) if ref else dict(color=f"C{i % 10}")
        hit_ax.plot(ns, [100 * r["block_hit_rate"] for _, r in pts], marker="o", label=name, **style)
        if not ref:
            ttft_ax.plot(ns, [r["ttft_p90_s"] for _, r in pts], marker="o", label=name, **style)
    for ax in (hit_ax, ttft_ax):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("engines")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    hit_ax.set_ylabel("prompt blocks served from cache (%)")
    hit_ax.set_title("Hit rate")
    ttft_ax.set_yscale("log")
    ttft_ax.set_ylabel("p90 time to first token (s)")
    ttft_ax.set_title("p90 TTFT")
    fig.suptitle(title)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
