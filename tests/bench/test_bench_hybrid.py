"""``kvos bench hybrid`` on the CPU with the tiny Gemma 3 shape (1 full-attention layer, 5 sliding
layers of window 32): the three layouts side by side, checked against the memory math."""
from __future__ import annotations

import json

from kvos.cli import main


def test_bench_hybrid_compares_the_layouts(tmp_path):
    out = tmp_path / "hybrid.json"
    rc = main(["bench", "hybrid", "--config", "gemma-3-tiny", "--random-weights",
               "--kv-cache-memory-bytes", str(64 << 20), "--max-num-batched-tokens", "256",
               "--capacity-context", "2048", "--requests", "4", "--prompt-len", "96", "--output-len", "4",
               "--micro-batches", "--output", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    homo, equal, unified = (r["layouts"][k]["capacity"] for k in ("homogeneous", "equal_pages", "unified"))
    # Per 2,048-token request (fp32, 2 KV heads of 128: 2 KiB per layer and token): homogeneous keeps
    # all 6 layers' tokens (24 MiB); the hybrid layouts keep the full layer's tokens (4 MiB) and, in
    # each sliding layer, the window's 3 blocks once decoding (the last request is still at its
    # peak: its last 256-token chunk plus the window, 19 blocks). 64 MiB hold 2 vs 13.
    assert homo["requests"] == 2
    assert unified["requests"] >= 6 * homo["requests"] and equal["requests"] >= 6 * homo["requests"]
    # unified waste: the last request's prefill chunk, partial blocks, and each request's last
    # large page of full-attention blocks (5 per page, packed per request): about 5%
    assert homo["waste_fraction"] > 0.75 and unified["waste_fraction"] < 0.06 and equal["waste_fraction"] < 0.06
    for layout in ("homogeneous", "equal_pages", "unified"):
        run = r["layouts"][layout]["long_context"]
        assert run["output_tokens"] == 4 * 4 and run["peak_running"] >= 1
    assert r["summary"]["unified"]["vs_homogeneous"] >= 6
