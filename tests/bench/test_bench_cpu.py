"""``kvos bench cpu`` on the default model: kvos on its kernels and on float32 weights give
transformers' greedy tokens for the whole (short) output, and the JSON has every row asked for."""
from __future__ import annotations

import argparse
import json


def test_cpu_bench_matches_transformers_tokens(tmp_path):
    from kvos.bench.cpu_stream import add_args, run

    p = argparse.ArgumentParser()
    add_args(p)
    out = tmp_path / "cpu.json"
    a = p.parse_args(["--engines", "kvos", "kvos-float32", "transformers", "--threads", "1", "--rounds", "1",
                      "--prompt-len", "48", "--output-len", "12", "--output", str(out)])
    result = run(a)
    rows = {r["engine"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"kvos", "kvos-float32", "transformers"} and result["prompt_tokens"] == 48
    for name in ("kvos", "kvos-float32"):
        assert rows[name]["same_tokens_as_transformers"] == 12, name
        assert rows[name]["decode_tok_s"] > 0 and rows[name]["ttft_s"] > 0
