"""The planner and the simulator on models with Mamba layers: a state page per request whatever
its length, sized as the engine sizes it; parameters as transformers counts them."""
from __future__ import annotations

import json

import pytest

from kvos.cache.spec import MambaStateSpec
from kvos.sim.hardware import resolve_gpu
from kvos.sim.planner import PlanInput, model_layout, plan
from kvos.sim.shapes import PRESETS, resolve_shape
from tests.support.hybrid_checkpoints import write_checkpoint


def test_bamba_preset_counts_what_transformers_builds():
    import torch
    from transformers import BambaConfig, BambaForCausalLM

    with torch.device("meta"):
        model = BambaForCausalLM(BambaConfig(attn_layer_indices=[9, 18, 27]))
    reference = sum(p.numel() for p in model.parameters())
    shape = PRESETS["bamba-9b"]
    assert abs(shape.params - reference) <= 1e-3 * reference, (shape.params, reference)
    # 29 Mamba layers of 128 heads x 64 x 256 float32 states plus a 3-input conv state of 8,704 channels
    assert shape.state_bytes_per_request() == 29 * (128 * 64 * 256 + 8704 * 3) * 4


@pytest.mark.parametrize("arch", ["granite", "mamba2"])
def test_plan_sizes_state_pages_as_the_engine(arch, tmp_path):
    from kvos.config.engine import EngineConfig
    from kvos.engine.state_layout import state_group
    from kvos.models.config import ModelConfig

    folder = write_checkpoint(arch, tmp_path / arch)
    cfg = json.loads((folder / "config.json").read_text())
    shape = resolve_shape(str(folder))
    spec, layers = state_group(ModelConfig.from_hf(cfg), EngineConfig(model=str(folder)))
    assert isinstance(spec, MambaStateSpec) and shape.mamba_layers == layers
    planned = model_layout(shape, "fp16", 16, "unified").groups[-1].spec
    assert planned.data_bytes == spec.data_bytes == shape.state_bytes_per_request()
    assert planned.cache_every == spec.cache_every
    r = plan(PlanInput(shape, resolve_gpu("h200"), context_len=1024))
    short = plan(PlanInput(shape, resolve_gpu("h200"), context_len=64))
    # the state part of a request does not grow with its length; KV grows only in attention layers
    kv = r["kv_bytes_per_token"]
    assert kv == (0 if arch == "mamba2" else 2 * 2 * 2 * 16)  # one attention layer, 2 KV heads of 16, fp16
    assert r["kv_bytes_per_request"] - short["kv_bytes_per_request"] == kv * (1024 - 64)
    assert r["state_bytes_per_request"] == spec.data_bytes


def test_simulator_runs_a_hybrid_with_its_state_group(tmp_path):
    """``kvos simulate`` on the Bamba preset: the report's groups are the engine's (attention KV,
    then the state group); every request finishes."""
    from kvos.cli import main

    out = tmp_path / "r.json"
    assert main(["simulate", "--synthetic", "--model", "bamba-9b", "--num-requests", "20", "--input-len",
                 "512:2048", "--output-len", "16:64", "--cache-gb", "20", "--json", "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [g["kind"] for g in report["kv_groups"]] == ["full_attention", "mamba_state"]
    assert report["num_requests"] == 20 and report["preemptions"] == 0


def test_elastic_pool_holds_what_the_best_fixed_split_holds(tmp_path):
    """``kvos bench state-split`` on the Bamba-9B shape: one pool for KV and state pages holds as
    many decoding requests as the fixed split tuned to each phase (long prompts, then short
    ones), and far more than the split tuned to the other phase."""
    import argparse

    from kvos.bench.state_split import run

    r = run(argparse.Namespace(model="bamba-9b", kv_gib=12.0, long_tokens=32768, short_tokens=512, block_size=16,
                               output=str(tmp_path / "split.json")))["rows"]
    elastic, for_long, for_short = r["elastic"], r["fixed for long"], r["fixed for short"]
    assert elastic["long"] >= for_long["long"] > 0 and elastic["short"] >= for_short["short"] > 0
    assert elastic["short"] >= 2 * for_long["short"] and elastic["long"] >= 4 * for_short["long"], r
