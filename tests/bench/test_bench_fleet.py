"""The fleet bench: its workload parts that need no engine (open-loop arrival times, the
one-unbounded-cache bound its hit rates are held against), and one small run of two real engine
processes on the CPU (the full runs are in benchmarks/routing.md)."""
from __future__ import annotations

import statistics

import pytest

from kvos.bench.fleet import PrefixBound, arrival_times

pytestmark = pytest.mark.slow


def test_arrivals_are_a_seeded_poisson_process():
    rate, n = 2.5, 4000
    t = arrival_times(n, rate, seed=7)
    assert t == arrival_times(n, rate, seed=7) and t != arrival_times(n, rate, seed=8)
    gaps = [b - a for a, b in zip(t, t[1:])]
    assert t[0] == 0 and min(gaps) >= 0
    # exponential gaps: mean 1/rate (standard error 1/rate/sqrt(n), 1.6% here) and a
    # coefficient of variation of 1 (evenly spaced arrivals would have 0)
    assert statistics.fmean(gaps) == pytest.approx(1 / rate, rel=0.06)
    assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(1.0, abs=0.08)


@pytest.mark.parametrize("rate", [0, -1.0, float("nan")])
def test_arrival_rate_must_be_positive(rate):
    with pytest.raises(ValueError, match="arrival_rate"):
        arrival_times(3, rate, seed=0)


def test_prefix_bound_counts_full_blocks_sent_before():
    bound = PrefixBound(block_size=4)
    system = list(range(100, 110))  # 10 tokens: two full blocks and a part
    assert bound.hit_tokens(system + [1, 2, 3]) == 0  # nothing sent before
    # the same system prompt, another user message: its two full blocks were sent
    assert bound.hit_tokens(system + [7, 8, 9]) == 8
    # a finished turn's prompt and reply: the next turn hits all of its full blocks but the last
    # token's (never computed)
    turn = system + [7, 8, 9] + [50, 51, 52, 53, 54]  # 18 tokens
    bound.add(turn[:-1])
    assert bound.hit_tokens(turn + [60, 61, 62]) == 16
    # the same prompt twice: only full blocks count, never the part of one
    again = system + [5]  # 11 tokens, 10 before the last: two full blocks and a part
    bound.hit_tokens(again)
    assert bound.hit_tokens(again) == 8
    # a block differing in one token breaks the chain from there on
    assert bound.hit_tokens([100, 101, 102, 999] + system[4:]) == 0


def test_fleet_bench_runs_two_real_engines_open_loop(tmp_path, capsys):
    """``kvos bench fleet`` end to end on the default model: two engine processes behind
    kv_aware, open-loop arrivals, a second turn that extends the first. Every request is routed
    and reported, and the engines' hit rate is positive but never above what one unbounded cache
    hits with the same arrivals."""
    import json

    from kvos.cli import main

    out = tmp_path / "fleet.json"
    rc = main(["bench", "fleet", "--conversations", "3", "--turns", "2", "--system-prompts", "1",
               "--system-len", "48", "--user-len", "8", "--max-tokens", "3", "--arrival-rate", "4",
               "--data-parallel", "2", "--routers", "kv_aware", "--num-blocks", "64", "--output", str(out)])
    assert rc == 0
    assert "| 2 x DP kv_aware |" in capsys.readouterr().out
    res = json.loads(out.read_text())
    assert res["machine"]["cores"] >= 1 and res["args"]["arrival_rate"] == 4
    (run,) = res["runs"]
    assert run["requests"] == 6 and sum(run["router"]["routed"]) == 6 and len(run["records"]) == 6
    assert run["output_tokens"] == 6 * 3
    assert 0 < run["hit_rate"] <= run["hit_rate_bound"] + 1e-9
