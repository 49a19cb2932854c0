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
