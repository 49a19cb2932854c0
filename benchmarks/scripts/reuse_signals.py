"""What an online eviction policy could know about the Mooncake traces' reuse (#44): an offline
study on the first requests of each trace, one request at a time (no concurrency, no lookahead),
full blocks only (a prompt's last, partial block is never cached).

1. LRU stack distances: the share of block references a pure LRU cache of C blocks hits (reuse
   distance below C, counted in distinct blocks between the two references).
2. Signals: for every block reference, the share reused within the next ``--horizon`` requests,
   bucketed by what is known online when the block is used: how often it was used before, the
   time since its last and its first use (log2 of requests), whether the request's prefix hit,
   the request's length (log2 of blocks) and the block's depth in it.
3. Policies with prefix semantics (a request hits only its longest cached prefix; a chain's tail
   is evicted before its head): LRU, the optimum (Belady, evicting the furthest next use first,
   deepest first among ties), and bimodal insertion (BIP: blocks new to the cache enter at the
   cold end, except one chain in ``m``, kept by a hash of its first block; a hit moves a block to
   the hot end), the classic remedy for reuse distances longer than the cache.

    python benchmarks/scripts/reuse_signals.py --output benchmarks/results/reuse-signals.json
"""
from __future__ import annotations

import argparse
import collections
import gzip
import heapq
import json
from pathlib import Path

TRACES = {"conversation": "mooncake_conversation.jsonl.gz", "synthetic": "mooncake_synthetic.jsonl.gz"}


def load(path: Path, limit: int) -> list[list[int]]:
    rows = [json.loads(line) for line in gzip.open(path)]
    return [r["hash_ids"][:-1] for r in (rows[:limit] if limit else rows)]


def lru_hit_by_size(reqs: list[list[int]], sizes: list[int]) -> dict[int, float]:
    refs = [h for r in reqs for h in r]
    n = len(refs)
    tree = [0] * (n + 1)  # Fenwick tree: 1 at each block's latest reference

    def add(i: int, v: int) -> None:
        i += 1
        while i <= n:
            tree[i] += v
            i += i & -i

    def prefix(i: int) -> int:
        s, i = 0, i + 1
        while i > 0:
            s += tree[i]
            i -= i & -i
        return s

    last: dict[int, int] = {}
    distances = []
    for t, h in enumerate(refs):
        if h in last:
            distances.append(prefix(t - 1) - prefix(last[h]))
            add(last[h], -1)
        last[h] = t
        add(t, 1)
    return {c: sum(d < c for d in distances) / n for c in sizes}


def signals(reqs: list[list[int]], horizon: int) -> dict[str, dict[str, list[float]]]:
    uses: dict[int, list[int]] = collections.defaultdict(list)
    for i, r in enumerate(reqs):
        for h in r:
            uses[h].append(i)
    seen: collections.Counter = collections.Counter()
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    table: dict[tuple[str, str], list[int]] = collections.defaultdict(lambda: [0, 0])
    for i, r in enumerate(reqs):
        k = 0
        while k < len(r) and seen[r[k]]:
            k += 1
        for j, h in enumerate(r):
            u = uses[h]
            reused = seen[h] + 1 < len(u) and u[seen[h] + 1] - i <= horizon
            feats = {"uses_before": min(seen[h], 4),
                     "log2_since_last": "never" if h not in last else min(10, (i - last[h]).bit_length()),
                     "log2_since_first": "never" if h not in first else min(10, (i - first[h]).bit_length()),
                     "request_prefix_hit": k > 0,
                     "log2_request_blocks": min(9, len(r).bit_length()),
                     "depth_tenths": round(j / len(r), 1)}
            for name, value in feats.items():
                cell = table[(name, str(value))]
                cell[0] += 1
                cell[1] += reused
            first.setdefault(h, i)
            last[h] = i
            seen[h] += 1
    out: dict[str, dict[str, list[float]]] = collections.defaultdict(dict)
    for (name, value), (n, hits) in sorted(table.items()):
        out[name][value] = [round(hits / n, 3), n]
    return out


def replay(reqs: list[list[int]], capacity: int, mode: str, keep_one_in: int = 32) -> float:
    """Prefix hit rate (blocks) of one policy; keys: the smallest is evicted first."""
    future: dict[int, collections.deque] = collections.defaultdict(collections.deque)
    for i, r in enumerate(reqs):
        for h in r:
            future[h].append(i)
    key: dict[int, float] = {}
    heap: list[tuple[float, int]] = []
    hits = total = 0
    for i, r in enumerate(reqs):
        k = 0
        while k < len(r) and r[k] in key:
            k += 1
        hits, total = hits + k, total + len(r)
        keep = bool(r) and hash((r[0], 7)) % keep_one_in == 0
        for j, h in enumerate(r):
            if mode == "belady":
                nxt = future[h]
                while nxt and nxt[0] <= i:
                    nxt.popleft()
                kk = -(nxt[0] if nxt else 10**9) - j * 1e-6
            elif mode == "lru" or h in key or keep:
                kk = i - j * 1e-6
            else:  # bip: new to the cache, at the cold end
                kk = -10**6 + i - j * 1e-6
            key[h] = kk
            heapq.heappush(heap, (kk, h))
        while len(key) > capacity:
            kk, h = heapq.heappop(heap)
            if key.get(h) == kk:
                del key[h]
    return hits / total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace-dir", default="tests/data")
    p.add_argument("--limit", type=int, default=3000)
    p.add_argument("--sizes", type=int, nargs="+", default=[2000, 4000, 8000])
    p.add_argument("--horizon", type=int, default=400, help="requests ahead counted as 'reused soon'")
    p.add_argument("--output", default="benchmarks/results/reuse-signals.json")
    a = p.parse_args()
    result: dict = {"limit": a.limit, "horizon": a.horizon, "traces": {}}
    for name, file in TRACES.items():
        reqs = load(Path(a.trace_dir) / file, a.limit)
        policies = {}
        for c in a.sizes:
            row = {"lru": replay(reqs, c, "lru"), "belady": replay(reqs, c, "belady")}
            row.update({f"bip_1_in_{m}": replay(reqs, c, "bip", m) for m in (4, 8, 32)})
            gap = row["belady"] - row["lru"]
            row = {k: round(v, 4) for k, v in row.items()}
            row["gap_closed"] = {k: round((v - row["lru"]) / gap, 3) for k, v in row.items()
                                 if k.startswith("bip")}
            policies[c] = row
            print(name, c, json.dumps(row), flush=True)
        result["traces"][name] = {"lru_stack_hit": lru_hit_by_size(reqs, a.sizes + [16000, 32000]),
                                  "signals": signals(reqs, a.horizon), "policies": policies}
    Path(a.output).write_text(json.dumps(result, indent=1))
    print(f"saved {a.output}")


if __name__ == "__main__":
    main()
