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
    from kvos.models.loader import default_model_path

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


def _max_n(pages_for, usable: int) -> int:
    n = 0
    while pages_for(n + 1) <= usable:
        n += 1
    return n


@pytest.mark.parametrize("tp", [1, 4])
def test_gemma3_27b_layouts_at_32k_match_hand_computation(tp):
    """Concurrency of 32K-token requests under the three layouts, recomputed here from first
    principles: Gemma 3 27B has 10 full-attention layers (5, 11, ..., 59) and 52 sliding ones
    (window 1024); fp16 K and V of 16 KV heads of 128 dims; 16-token blocks."""
    g = PRESETS["gemma-3-27b"]
    assert (g.num_layers, g.num_heads, g.num_kv_heads, g.head_dim, g.hidden_size, g.intermediate_size,
            g.sliding_window, g.sliding_layers) == (62, 32, 16, 128, 5376, 21504, 1024, 52)
    assert [i for i, w in enumerate(g.layer_windows()) if w is None] == list(range(5, 62, 6))
    r = plan(PlanInput(g, GPUS["H100-80G"], context_len=32768, tensor_parallel=tp))
    mem, lay = r["kv_memory_bytes"], r["kv_layouts"]
    per_layer = 2 * (16 // tp) * 128 * 2                   # B per token and layer on one GPU
    full_bpt, slide_bpt = 10 * per_layer, 52 * per_layer   # 81,920 and 425,984 B at TP 1
    full_blocks = 32768 // 16                              # 2048: every block
    win_blocks = -(-(1024 - 1) // 16) + 1                  # 65: the next token reads 1023 before it
    live = full_bpt * 32768 + slide_bpt * 1023
    # homogeneous: one group of 62 layers, every block kept
    page_h = 62 * per_layer * 16
    n_h = (mem // page_h - 1) // full_blocks               # page 0 holds the null blocks
    # equal pages: groups of 10 layers (the full group's size): 1 full + 6 sliding (the last has 2
    # layers + 8 padding slots), every page 10 layers x 16 tokens
    page_e = 10 * per_layer * 16
    n_e = (mem // page_e - 1) // (full_blocks + 6 * win_blocks)
    # unified: large page = lcm(full page, sliding page) = 26 full blocks = 5 sliding blocks
    page_full, page_slide = full_bpt * 16, slide_bpt * 16
    page_u = page_full * 26
    assert page_u == page_slide * 5 and page_u == 34_078_720 // tp  # 32.5 MiB at TP 1
    n_u = _max_n(lambda n: -(-n * full_blocks // 26) + -(-n * win_blocks // 5), mem // page_u - 1)
    got = {m: lay[m]["max_concurrent_requests"] for m in ("homogeneous", "equal_pages", "unified")}
    assert got == {"homogeneous": n_h, "equal_pages": n_e, "unified": n_u}
    assert {m: lay[m]["page_bytes"] for m in got} == {"homogeneous": page_h, "equal_pages": page_e, "unified": page_u}
    if tp == 1:  # what `kvos plan --model gemma-3-27b --context-len 32768` prints (its SigLIP tower's
        assert got == {"homogeneous": 1, "equal_pages": 6, "unified": 6}  # weights included: 0.42 B)
    else:
        assert got == {"homogeneous": 15, "equal_pages": 78, "unified": 80}
        assert 4 < n_u / n_h < 6  # the live-byte ratio: 62 x 32768 / (10 x 32768 + 52 x 1023) = 5.33
    assert n_h < n_e <= n_u
    assert r["max_concurrent_requests_paged"] == n_u  # paged = the engine's default layout
    # waste at that load: allocated pages not holding live tokens
    assert lay["homogeneous"]["waste_fraction"] == pytest.approx(1 - live / (62 * per_layer * 32768))
    alloc_u = (-(-n_u * full_blocks // 26) + -(-n_u * win_blocks // 5)) * page_u
    assert lay["unified"]["waste_fraction"] == pytest.approx(1 - n_u * live / alloc_u)
    assert lay["unified"]["waste_fraction"] < 0.01
    assert 0.01 < lay["equal_pages"]["waste_fraction"] < 0.05 < 0.8 < lay["homogeneous"]["waste_fraction"]
    groups = lay["unified"]["groups"]
    assert [(x["kind"], len(x["layers"]), x["bytes_per_token"], x["window"], x["blocks_per_request"])
            for x in groups] == [("full_attention", 10, full_bpt, None, 2048),
                                 ("sliding_window", 52, slide_bpt, 1024, 65)]


def test_non_hybrid_model_same_in_every_layout_and_output_unchanged():
    from kvos.sim.planner import plan_layouts

    s = PRESETS["llama-3.1-8b"]
    r = plan(PlanInput(s, GPUS["H100-80G"], context_len=32768))
    lay = plan_layouts(s, "fp16", 16, 32768, r["kv_memory_bytes"])
    assert len({(x["max_concurrent_requests"], x["page_bytes"], x["waste_fraction"]) for x in lay.values()}) == 1
    assert lay["unified"]["max_concurrent_requests"] == r["max_concurrent_requests_paged"] == 14
    assert "kv_layouts" not in r  # a dense model's plan keeps its old figures and table
    out = run_cli("--model", "llama-3.1-8b", "--context-len", "32768")
    assert "blocks in pool" in out.stdout and "KV layouts" not in out.stdout


def test_kv_bytes_use_the_cache_spec_formula():
    from kvos.cache.spec import FullAttentionSpec
    from kvos.sim.hardware import KV_DTYPES, kv_bytes_per_token

    # K and V x 32 layers x 8 kv heads x (128 values, plus a float32 scale when quantized)
    per_head = {"fp32": 4 * 128, "fp16": 2 * 128, "bf16": 2 * 128, "fp8": 128 + 4, "fp8_e4m3": 128 + 4,
                "int8": 128 + 4}
    assert set(per_head) == set(KV_DTYPES)
    for name, spec_dtype in KV_DTYPES.items():
        assert kv_bytes_per_token(32, 8, 128, name) == FullAttentionSpec(16, 32, 8, 128, spec_dtype).bytes_per_token
        assert kv_bytes_per_token(32, 8, 128, name) == 2 * 32 * 8 * per_head[name]


def test_gemma3_presets_match_their_configs_and_plan_cli(capsys):
    from pathlib import Path

    import kvos.models
    from kvos.cli import main
    from kvos.models.config import ModelConfig

    configs = Path(kvos.models.__file__).parent / "configs"
    for name in ("gemma-3-12b", "gemma-3-27b"):
        preset, cfg = PRESETS[name], resolve_shape(str(configs / f"{name}.json"))
        assert preset.layer_windows() == cfg.layer_windows()
        assert (preset.num_layers, preset.num_heads, preset.num_kv_heads, preset.head_dim, preset.hidden_size,
                preset.intermediate_size, preset.vocab_size, preset.sliding_window) == \
               (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size,
                cfg.intermediate_size, cfg.vocab_size, cfg.sliding_window)
        mc = ModelConfig.from_hf(json.loads((configs / f"{name}.json").read_text()))
        assert mc.layer_windows() == preset.layer_windows()  # what the engine builds its layout from
    g12 = PRESETS["gemma-3-12b"]
    assert (g12.num_layers, g12.num_heads, g12.num_kv_heads, g12.head_dim, g12.hidden_size,
            g12.intermediate_size, g12.vocab_size, g12.sliding_window, g12.sliding_layers) == \
           (48, 16, 8, 256, 3840, 15360, 262208, 1024, 40)
    assert main(["plan", "--model", "gemma-3-27b", "--context-len", "32768"]) == 0
    text = capsys.readouterr().out
    assert "KV layouts" in text and "homogeneous" in text and "equal_pages" in text and "unified" in text
    assert "10 full + 52 sliding" in text and "10 full + 6 x 10 sliding (8 pad)" in text
    assert main(["plan", "--model", "gemma-3-27b", "--context-len", "32768", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [out["kv_layouts"][m]["max_concurrent_requests"] for m in ("homogeneous", "equal_pages", "unified")] \
        == [1, 6, 6]  # 7 unified without the SigLIP tower's weights (0.42 B), which the checkpoint holds


@pytest.mark.parametrize("window, block_size", [(17, 16), (16, 16), (512, 16), (1024, 16), (33, 8), (5, 4)])
def test_planner_window_blocks_match_the_kv_manager(window, block_size):
    """The planner's blocks per request are the peak the real manager holds while a long request
    decodes one token per step (sliding groups free the blocks that left the window)."""
    from dataclasses import dataclass, field

    from kvos.cache.kv_manager import KVCacheManager
    from kvos.cache.layout import build_layout
    from kvos.sim.planner import group_blocks

    @dataclass(eq=False)
    class Seq:
        request_id: str
        all_token_ids: list = field(default_factory=list)
        num_computed_tokens: int = 0
        cache_salt: str | None = None
        priority: int = 0

        @property
        def num_tokens(self) -> int:
            return len(self.all_token_ids)

    layout = build_layout([window, None], block_size, 1, 1, "float32", "unified")
    kv = KVCacheManager(layout, 4096)
    tokens = 6 * window + 3
    seq = Seq("r", [1])
    peak = [0, 0]
    for _ in range(tokens):
        assert kv.allocate_slots(seq, 1)
        seq.num_computed_tokens += 1
        seq.all_token_ids.append(seq.num_computed_tokens + 1)
        for g, m in enumerate(kv.managers):
            peak[g] = max(peak[g], m.num_held_blocks("r"))
    assert peak == [group_blocks(g.spec, tokens) for g in layout.groups]
    assert layout.groups[0].spec.kind == "full_attention" and peak[0] == -(-tokens // block_size)


def test_a_draft_model_s_weights_and_kv_group_are_counted():
    """Llama-3.1-8B with Llama-3.2-1B as its draft: per token 131,072 B of target KV (32 layers x 8
    heads x 128 x 2 B x K,V) plus 32,768 B of draft KV (16 x 8 x 64 x 2 x 2); a request of 8,192
    tokens holds 512 target blocks (one 2 MiB page each) and 512 draft blocks (four to a page)."""
    base = PlanInput(PRESETS["llama-3.1-8b"], GPUS["H200"], context_len=8192)
    alone = plan(base)
    d = PRESETS["llama-3.2-1b"]
    r = plan(PlanInput(PRESETS["llama-3.1-8b"], GPUS["H200"], context_len=8192, draft=d))
    assert r["draft_kv_bytes_per_token"] == 32_768 and r["kv_bytes_per_token"] == 131_072 + 32_768
    assert r["draft_weight_bytes"] == d.params * 2 and r["weight_bytes"] == alone["weight_bytes"] + d.params * 2
    assert r["kv_bytes_per_request"] == 8192 * 163_840
    usable = r["kv_memory_bytes"] // (131_072 * 16) - 1
    assert r["page_bytes"] == 131_072 * 16 and r["max_concurrent_requests_paged"] == usable // (512 + 128)
    assert r["max_concurrent_requests_paged"] < alone["max_concurrent_requests_paged"]
    out = run_cli("--model", "llama-3.1-8b", "--draft-model", "llama-3.2-1b", "--gpu", "H200")
    assert out.returncode == 0 and "draft model" in out.stdout and "32,768 B/token" in out.stdout
