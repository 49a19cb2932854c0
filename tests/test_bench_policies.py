"""``kvos bench policies`` on a small slice: every row is bounded by the optimum, the table and
JSON hold every policy and size, and the summary names the gap closed."""
from __future__ import annotations

import json

from kvos.cli import main


def test_bench_policies_small(tmp_path, capsys):
    out = tmp_path / "policies.json"
    rc = main(["bench", "policies", "--traces", "synthetic", "--limit", "300", "--sizes", "100", "400",
               "--policies", "lru", "arc", "weighted", "--lookaheads", "0", "64", "--jobs", "1",
               "--output", str(out), "--plot", str(tmp_path / "p.png")])
    assert rc == 0
    report = json.loads(out.read_text())
    rows = report["results"]["synthetic"]
    assert len(rows) == 2 * (1 + 3 * 2)
    for r in rows:
        opt = next(o for o in rows if o["policy"] == "belady" and o["size"] == r["size"])
        assert r["token_hit_rate"] <= opt["token_hit_rate"] + 1e-12, r
        assert 0 <= r["of_optimum"] <= 1
    summary = report["summary"]["synthetic"]
    assert [s["size"] for s in summary] == [100, 400]
    assert all(s["lru"] <= s["best_hit"] <= s["optimum"] for s in summary)
    assert (tmp_path / "p.png").stat().st_size > 0
    assert "optimum (belady)" in capsys.readouterr().out
