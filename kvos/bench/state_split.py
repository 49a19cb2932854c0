"""``kvos bench state-split``: requests held at once by one pool of KV and Mamba state pages, the
elastic pool (any group takes any free large page) against fixed splits, as the workload shifts
between long prompts (KV-heavy) and short ones (state-heavy). Pure Python, the engine's own
``KVCacheManager`` and the planner's layout of the model (default: the Bamba-9B shape, bf16 KV,
float32 state).

Each phase admits requests of one length, one at a time (its prompt allocated and computed, then
two decode tokens, which release the prefill's state checkpoints and the block the first one
crossed from), until the pool refuses one: the requests decoding at once between block
boundaries (a step that crosses one holds a second state page for that step). Then it frees them. A fixed split gives the state group the share of
large pages that one phase's requests need (``fixed for long``, ``fixed for short``) and the KV
group the rest; the elastic pool is one pool for both phases, unchanged in between.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="bamba-9b", help="a planner preset or config.json with Mamba layers")
    p.add_argument("--kv-gib", type=float, default=96.0, help="the pool's memory")
    p.add_argument("--long-tokens", type=int, default=32768)
    p.add_argument("--short-tokens", type=int, default=512)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--output", default="benchmarks/results/state_split.json")


@dataclass(eq=False)
class _Seq:
    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int = 0
    cache_salt: str | None = None
    priority: int = 0
    extra: list = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


def held_at_once(layout, num_pages: int, tokens: int, quota: dict[int, int] | None) -> int:
    """Requests of ``tokens`` tokens one pool admits before refusing one."""
    from kvos.cache.kv_manager import KVCacheManager

    kv = KVCacheManager(layout, num_pages, enable_caching=False, page_quota=quota)
    n = 0
    while True:
        seq = _Seq(f"r{n}", [0] * tokens)
        if not kv.allocate_slots(seq, tokens):
            return n
        for _ in range(2):  # two decode steps
            seq.num_computed_tokens = seq.num_tokens
            seq.all_token_ids.append(0)
            if not kv.allocate_slots(seq, 1):
                return n
        n += 1


def run(a: argparse.Namespace) -> dict:
    from kvos.bench.machine import machine_info
    from kvos.cache.full_attention import cdiv
    from kvos.sim.planner import model_layout
    from kvos.sim.shapes import resolve_shape

    shape = resolve_shape(a.model)
    if shape.mamba is None:
        raise ValueError(f"model: {a.model} has no Mamba layers")
    layout = model_layout(shape, "fp16", a.block_size, "unified")
    state = len(layout.groups) - 1
    num_pages = layout.num_pages_for_memory(int(a.kv_gib * (1 << 30)))
    usable = num_pages - 1

    def state_share(tokens: int) -> int:
        """Large pages for the state group when every request has ``tokens`` tokens."""
        kv_pages = sum(cdiv(tokens, a.block_size) / layout.blocks_per_large_page(g) for g in range(state))
        return max(1, min(usable - 1, round(usable / (1 + kv_pages))))

    splits = {"elastic": None,
              "fixed for long": {state: state_share(a.long_tokens)},
              "fixed for short": {state: state_share(a.short_tokens)}}
    for name in ("fixed for long", "fixed for short"):  # the KV groups share the rest
        q = splits[name]
        for g in range(state):
            q[g] = usable - q[state]
    rows = {}
    for name, quota in splits.items():
        long_n = held_at_once(layout, num_pages, a.long_tokens, quota)
        short_n = held_at_once(layout, num_pages, a.short_tokens, quota)
        rows[name] = {"state_pages": None if quota is None else quota[state], "long": long_n, "short": short_n}
        print(name, json.dumps(rows[name]), flush=True)
    e = rows["elastic"]
    summary = {name: {"long": e["long"] / r["long"] if r["long"] else None,
                      "short": e["short"] / r["short"] if r["short"] else None}
               for name, r in rows.items() if name != "elastic"}
    result = {"machine": machine_info(), "model": shape.name, "kv_gib": a.kv_gib, "pages": num_pages,
              "page_bytes": layout.large_page_bytes, "long_tokens": a.long_tokens, "short_tokens": a.short_tokens,
              "rows": rows, "summary": {"elastic_over_fixed": summary}}
    out = Path(a.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"saved {out}")
    return result
