"""``kvos bench sampling`` on the CPU: every kind runs the same requests to their full length."""
from __future__ import annotations

import argparse
import json


def test_sampling_bench_runs_each_kind(tmp_path):
    from kvos.bench.sampling import KINDS, add_args, run
    from kvos.config.flags import add_engine_args

    p = argparse.ArgumentParser()
    add_engine_args(p)
    add_args(p)
    out = tmp_path / "s.json"
    a = p.parse_args(["--requests", "3", "--input-len", "5", "--output-len", "3", "--rounds", "1",
                      "--max-num-seqs", "4", "--output", str(out)])
    result = run(a)
    assert set(result["best_seconds"]) == set(KINDS) and result["vs_greedy"]["greedy"] == 1.0
    assert json.loads(out.read_text())["workload"]["requests"] == 3
