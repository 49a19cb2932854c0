"""``kvos bench kv-quant`` on SmolLM2 with tiny settings: the JSON it saves, the harness exact for
``auto`` against the reference run, and 8-bit KV off by a little, not a lot."""
from __future__ import annotations

import json

from kvos.cli import main

# fp8 e4m3 keeps 3 mantissa bits (relative error up to 2**-4 per value), int8 a step of amax/127
# per row. On SmolLM2 (tiny run: 3 prompts, 4 tokens) that moves logits by ~0.2-0.3 on average
# and ~1-2 at most; the bounds leave room, and would catch scales lost or misapplied (errors of
# the logits' own size, ~10 and more).
MEAN_LOGIT_ERROR_BOUND = 1.0
MAX_LOGIT_ERROR_BOUND = 8.0
PPL_DELTA_BOUND_PCT = 10.0


def test_bench_kv_quant_reports_exact_auto_and_bounded_8bit_error(tmp_path):
    out = tmp_path / "kv_quant.json"
    rc = main(["bench", "kv-quant", "--models", "smollm2", "--num-prompts", "3", "--long-prompts", "1",
               "--long-prompt-tokens", "200", "--max-tokens", "4", "--ppl-tokens", "256", "--out", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert {"machine", "engine", "settings", "models", "summary"} <= set(r)
    m = r["models"]["smollm2"]
    assert len(m["prompt_lengths"]) == 3 and sum(n > 200 for n in m["prompt_lengths"]) >= 1
    assert m["ppl_tokens"] == 256 and m["reference_ppl"] > 1
    rows = m["kv_dtypes"]
    assert set(rows) == {"auto", "fp8_e4m3", "int8"}
    for row in rows.values():
        assert {"kv_bytes_per_token", "greedy_agreement", "mean_identical_prefix", "mean_abs_logit_error",
                "max_abs_logit_error", "perplexity", "ppl_delta_pct", "forced_top1_agreement"} <= set(row)
    auto = rows["auto"]
    assert auto["greedy_agreement"] == 1.0 and auto["mean_identical_prefix"] == 4.0
    assert auto["mean_abs_logit_error"] == 0.0 and auto["max_abs_logit_error"] == 0.0
    assert auto["ppl_delta_pct"] == 0.0 and auto["perplexity"] == m["reference_ppl"]
    # 30 layers x 3 KV heads x (K, V): 64 float32 values, or 64 bytes and a float32 scale
    assert auto["kv_bytes_per_token"] == 2 * 30 * 3 * 64 * 4
    for dtype in ("fp8_e4m3", "int8"):
        row = rows[dtype]
        assert row["kv_bytes_per_token"] == 2 * 30 * 3 * (64 + 4)
        assert 0 < row["mean_abs_logit_error"] < MEAN_LOGIT_ERROR_BOUND, dtype
        assert row["mean_abs_logit_error"] <= row["max_abs_logit_error"] < MAX_LOGIT_ERROR_BOUND, dtype
        assert abs(row["ppl_delta_pct"]) < PPL_DELTA_BOUND_PCT, dtype
        assert 0 <= row["greedy_agreement"] <= 1 and row["nonfinite_logit_rows"] == 0
    assert set(r["summary"]) == {"smollm2 auto", "smollm2 fp8_e4m3", "smollm2 int8"}
