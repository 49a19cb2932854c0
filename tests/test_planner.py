"""``kvos plan``: exact memory math and sensible hybrid-model figures."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvos.sim.hardware import GIB, GPUS
from kvos.sim.planner import PlanInput, plan
from kvos.sim.shapes import PRESETS, resolve_shape


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvos.cli", "plan", *args], capture_output=True, text=True,
                          timeout=120)


def test_llama3_70b_reference_figures():
    r = run_cli("--model", "llama-3-70b", "--context-len", "8192", "--num-requests", "32", "--json",
                "--weight-dtype", "fp16", "--kv-dtype", "fp16")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["kv_bytes_per_token"] == 327_680
    assert out["kv_bytes_per_request"] == int(2.5 * GIB)
    assert out["kv_bytes_for_num_requests"] == 80 * GIB
    assert out["max_concurrent_requests_paged"] == 0 and not out["fits"]  # 131 GiB of fp16 weights
    tp4 = plan(PlanInput(PRESETS["llama-3-70b"], GPUS["H100-80G"], "fp16", "fp16", 8192, tensor_parallel=4))
    assert tp4["kv_bytes_per_token"] == 327_680 // 4 and tp4["max_concurrent_requests_paged"] > 0
    assert tp4["decode_bound"] == "memory"


def test_gemma3_sliding_layers_are_capped_by_the_window():
    g = PRESETS["gemma-3-270m"]
    assert (g.num_layers, g.sliding_layers, g.sliding_window) == (18, 15, 512)
    short = plan(PlanInput(g, GPUS["L4"], context_len=256))
    long = plan(PlanInput(g, GPUS["L4"], context_len=8192))
    per_layer = 2 * 1 * 256 * 2
    assert short["kv_bytes_per_request"] == per_layer * 18 * 256
    assert long["kv_bytes_per_request"] == per_layer * (3 * 8192 + 15 * 512)
    # a dense model of the same shape would hold 18 full layers: the window saves most of it
    assert long["kv_bytes_per_request"] < 0.25 * per_layer * 18 * 8192
    assert long["max_concurrent_requests_paged"] > 3 * long["max_concurrent_requests_contiguous"]


def test_paged_beats_contiguous_with_varied_lengths():
    r = run_cli("--model", "llama-3.1-8b", "--gpu", "H100-80G", "--length-dist", "256:8192", "--json")
    out = json.loads(r.stdout)
    assert out["max_concurrent_requests_paged"] > 1.8 * out["max_concurrent_requests_contiguous"]


def test_gguf_and_hf_config_inputs(tmp_path):
    from kvos.model.loader import default_model_path

    s = resolve_shape(str(default_model_path()))
    assert (s.num_layers, s.num_kv_heads, s.head_dim) == (30, 3, 64)
    assert 130e6 < s.params < 140e6
    out = plan(PlanInput(s, GPUS["L4"], kv_dtype="fp16"))
    assert out["kv_bytes_per_token"] == 2 * 30 * 3 * 64 * 2
    cfg = {"architectures": ["LlamaForCausalLM"], "num_attention_heads": 32, "num_key_value_heads": 8,
           "num_hidden_layers": 32, "hidden_size": 4096, "intermediate_size": 14336, "vocab_size": 128256}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert resolve_shape(str(tmp_path)).params == PRESETS["llama-3.1-8b"].params
    gemma = {"model_type": "gemma3_text", "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
             "num_hidden_layers": 18, "hidden_size": 640, "intermediate_size": 2048, "vocab_size": 262144,
             "sliding_window": 512, "layer_types": ["sliding_attention"] * 5 + ["full_attention"]
             + ["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"] * 5 + ["full_attention"]}
    (tmp_path / "config.json").write_text(json.dumps(gemma))
    s = resolve_shape(str(tmp_path / "config.json"))
    assert (s.sliding_layers, s.sliding_window) == (15, 512)


def test_bad_inputs_name_the_field():
    for args, field in [(("--model", "nope"), "model"), (("--model", "llama-3.1-8b", "--gpu", "Z80"), "gpu"),
                        (("--model", "llama-3.1-8b", "--kv-dtype", "fp4"), "kv_dtype"),
                        (("--model", "llama-3.1-8b", "--length-dist", "9:1"), "length_dist")]:
        r = run_cli(*args)
        assert r.returncode == 2 and field in r.stderr, (args, r.stderr)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        PlanInput(PRESETS["llama-3.1-8b"], GPUS["L4"], gpu_memory_utilization=1.5)
