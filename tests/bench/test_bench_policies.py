"""``kvos bench policies`` on a small slice: every row is bounded by the optimum, the table and
JSON hold every policy and size, and the summary names the gap closed."""
from __future__ import annotations

import json

import pytest

from kvos.cli import main

pytestmark = pytest.mark.slow


def test_bench_policies_small(tmp_path, capsys):
    out = tmp_path / "policies.json"
    rc = main(["bench", "policies", "--traces", "synthetic", "--limit", "150", "--sizes", "100", "400",
               "--policies", "lru", "weighted", "--lookaheads", "0", "64", "--tier-ratios", "0", "2",
               "--tier-policies", "lru", "s3fifo", "--jobs", "1",
               "--max-num-seqs", "1", "--max-num-batched-tokens", "8192", "--output", str(out), "--plot", str(tmp_path / "p.png")])
    assert rc == 0
    report = json.loads(out.read_text())
    rows = report["results"]["synthetic"]
    # per size: without a tier the optimum and 2 policies x 2 lookaheads; with one the optimum of
    # both memories, plain LRU, 2 device policies, 1 more tier policy, write-back, and the tier's
    # lookahead (1024 by default) write-through and write-back
    assert len(rows) == 2 * (1 + 2 * 2) + 2 * (1 + 1 + 2 + 1 + 1 + 2)
    assert sum(1 for r in rows if r["tier_lookahead"]) == 2 * 2
    for r in rows:
        opt = next(o for o in rows if o["policy"] == "belady" and o["size"] == r["size"]
                   and o["tier_blocks"] == r["tier_blocks"])
        assert r["token_hit_rate"] <= opt["token_hit_rate"] + 1e-12, r
        assert 0 <= r["of_optimum"] <= 1
    tiered = [r for r in rows if r["tier_blocks"] and r["policy"] != "belady"]
    assert {r["tier_blocks"] for r in tiered} == {200, 800} and all(r["tier_token_hit_rate"] >= 0 for r in tiered)
    summary = report["summary"]["synthetic"]
    assert [(s["size"], s["tier_ratio"]) for s in summary] == [(100, 0), (400, 0), (100, 2), (400, 2)]
    assert all(s["lru"] <= s["best_hit"] <= s["optimum"] for s in summary)
    assert (tmp_path / "p.png").stat().st_size > 0
    assert "optimum (belady)" in capsys.readouterr().out
