"""``kvos bench kv-speed`` on the CPU with a tiny Llama shape: the model's dtype (float32 here)
and 8-bit KV side by side, checked against the memory math."""
from __future__ import annotations

import json

from kvos.cli import main


def test_bench_kv_speed_holds_the_tokens_the_format_says(tmp_path):
    out = tmp_path / "kv_speed.json"
    rc = main(["bench", "kv-speed", "--config", "llama-tiny", "--random-weights", "--kv-dtypes", "auto", "fp8_e4m3",
               "int8", "--kv-cache-memory-bytes", str(16 << 20), "--requests", "3", "--prompt-len", "40",
               "--output-len", "4", "--micro-batches", "--output", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    cfg = json.loads((__import__("kvos.models.loader", fromlist=["x"]).resolve_config_path("llama-tiny")).read_text())
    layers, kvh = cfg["num_hidden_layers"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    for name, per_head in (("auto", 4 * hd), ("fp8_e4m3", hd + 4), ("int8", hd + 4)):
        row = r["kv_dtypes"][name]
        assert row["bytes_per_token"] == 2 * layers * kvh * per_head
        assert row["pool_pages"] == row["planner_pages_same_bytes"] == (16 << 20) // (16 * row["bytes_per_token"])
        assert row["long_context"]["output_tokens"] == 3 * 4
    assert r["summary"]["fp8_e4m3"]["tokens_vs_auto"] >= 0.99 * 4 * hd / (hd + 4)
