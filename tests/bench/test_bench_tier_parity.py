"""``kvos bench tier-parity`` on a short trace: the engine's CPU tier and the simulated tier serve
the same prompt tokens from the tier, request by request, under LRU and S3-FIFO; and S3-FIFO
resists the scan where LRU cannot (a hot prompt's reuse distance exceeds the tier, so LRU serves
nothing, while S3-FIFO's ghost list brings the prompt back into its main queue)."""
from __future__ import annotations

import json

import pytest

from kvos.cli import build_parser

pytestmark = pytest.mark.slow


def test_engine_tier_serves_what_the_simulated_tier_serves(tmp_path, make_llm, capsys):
    out = tmp_path / "parity.json"
    a = build_parser().parse_args(["bench", "tier-parity", "--rounds", "8", "--policies", "lru", "s3fifo",
                                   "--output", str(out)])
    a.bench_run(a, make_llm)
    report = json.loads(out.read_text())
    rows = {r["policy"]: r for r in report["rows"]}
    assert report["requests"] == 16 and report["machine"]
    for r in rows.values():
        assert r["engine_per_request"] == r["sim_per_request"], r["policy"]
        assert r["agree"] and r["requests_agree"] == 16
    assert rows["lru"]["engine_tier_tokens"] == 0
    # the second hot prompt's third use (request 14) loads all 16 of its blocks from the tier
    hits = rows["s3fifo"]["engine_per_request"]
    assert hits[14] == 16 * 16 and sum(hits) == hits[12] + hits[14] and hits[12] > 0
    assert f"| s3fifo | {sum(hits)} | {sum(hits)} | 16 of 16 |" in capsys.readouterr().out
