"""Bamba, Granite 4.0-H and Mamba2 (tiny random checkpoints written by transformers) in the
engine on the CPU in fp32 against transformers on the same folders: greedy tokens identical and
per-step logits within 1e-3 of the largest, on prompts of many blocks; the same with the state
restored from the prefix cache, prefill in chunks that cross block boundaries, preemption in a
pool too small for all requests, and n = 2 forks sharing the prompt's state."""
from __future__ import annotations

import json

import pytest
import torch

from kvos import LLM, SamplingParams
from tests.support.hf_reference import greedy_with_logits
from tests.support.hybrid_checkpoints import ARCHS, VOCAB, write_checkpoint

NEW_TOKENS = 10
BLOCK = 4


@pytest.fixture(scope="module", params=ARCHS)
def arch_case(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = write_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    gen = torch.Generator().manual_seed(1)
    shared = torch.randint(3, VOCAB, (41,), generator=gen).tolist()
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (3, 29, 70)]
    prompts.append(shared + [5, 6, 7])  # shares 41 tokens (10 blocks) with the next one
    prompts.append(shared + [9, 9])
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    reference = [hf_generate(hf, p) for p in prompts]
    return request.param, path, prompts, reference


@torch.inference_mode()
def hf_generate(hf, ids: list[int]) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy ``generate`` with its own hybrid cache: tokens and each step's logits."""
    out = hf.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                      output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    return out.sequences[0, len(ids):].tolist(), [row[0].float() for row in out.logits]


def run(llm: LLM, prompts, n: int = 1):
    return greedy_with_logits(llm, prompts, NEW_TOKENS, n)


def check(outs, logits, reference) -> None:
    for o, (ref_tokens, ref_logits) in zip(outs, reference):
        for c in o.outputs:
            assert c.token_ids == ref_tokens, (len(o.prompt_token_ids), c.token_ids, ref_tokens)
        ours = logits[o.request_id]
        assert len(ours) == NEW_TOKENS
        for step, (a, b) in enumerate(zip(ours, ref_logits)):
            err, tol = (a - b).abs().max().item(), 1e-3 * b.abs().max().item()
            assert err <= tol, f"step {step} of a {len(o.prompt_token_ids)}-token prompt: {err:.2e} > {tol:.2e}"


def test_greedy_tokens_and_logits_match_transformers(arch_case):
    arch, path, prompts, reference = arch_case
    llm = LLM(model=str(path), block_size=BLOCK, skip_tokenizer_init=True, mamba_cache_every=1,
              kv_cache_memory_bytes=16 << 20)
    kinds = [g["kind"] for g in llm.stats()["groups"]]
    assert kinds == (["mamba_state"] if arch == "mamba2" else ["full_attention", "mamba_state"])
    outs, logits = run(llm, prompts[:4])
    check(outs, logits, reference[:4])
    # the state after the shared 40 tokens (block 9) was kept: the last prompt restores it
    outs, logits = run(llm, prompts[4:])
    check(outs, logits, reference[4:])
    assert outs[0].num_cached_tokens == 40
    outs, logits = run(llm, prompts)  # every prompt again: all hit
    check(outs, logits, reference)
    assert [o.num_cached_tokens for o in outs] == [0, 28, 68, 40, 40]
    assert llm.stats()["used"] == 0


@pytest.mark.parametrize("options", [
    dict(max_num_batched_tokens=7, mamba_cache_every=3),  # chunks end inside blocks; checkpoints every 3
    dict(num_blocks=6, max_num_batched_tokens=32),  # too small for all at once: preemption
    dict(num_blocks=6, max_num_batched_tokens=32, preemption_mode="swap", swap_space_gb=0.05),
], ids=["chunked", "preemption", "swap"])
def test_scheduling_never_changes_the_answer(arch_case, options, monkeypatch):
    from kvos.models import mamba

    monkeypatch.setattr(mamba, "SCAN_CHUNK", 16)  # long prefill pieces run in several sub-chunks
    _, path, prompts, reference = arch_case
    llm = LLM(model=str(path), block_size=BLOCK, skip_tokenizer_init=True, **options)
    outs, logits = run(llm, prompts)
    check(outs, logits, reference)
    stats = llm.stats()
    if "num_blocks" in options:
        assert stats["preemptions"] > 0
        if options.get("preemption_mode") == "swap":
            assert stats["swapped_in_blocks"] > 0, stats
    else:
        assert outs[4].num_cached_tokens == 36  # the checkpoint after block 8 (every 3rd block)
    assert stats["used"] == 0


def test_n2_forks_copy_the_shared_state(arch_case):
    _, path, prompts, reference = arch_case
    llm = LLM(model=str(path), block_size=BLOCK, skip_tokenizer_init=True, kv_cache_memory_bytes=16 << 20)
    outs, _ = run(llm, prompts[1:3], n=2)
    for o, (ref_tokens, _) in zip(outs, reference[1:3]):
        assert [c.token_ids for c in o.outputs] == [ref_tokens, ref_tokens]
    assert llm.stats()["cow_copies"] > 0  # the forks' first decode wrote a copy of the prompt's state


def test_unknown_layer_type_is_refused_naming_the_layer(tmp_path):
    folder = write_checkpoint("granite", tmp_path / "g")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["layer_types"][2] = "gated_deltanet"
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="layer 2 has type 'gated_deltanet'"):
        LLM(model=str(folder), skip_tokenizer_init=True)


def test_features_that_need_a_rewindable_cache_are_refused(tmp_path):
    folder = write_checkpoint("mamba2", tmp_path / "m")
    with pytest.raises(ValueError, match="speculative_config"):
        LLM(model=str(folder), skip_tokenizer_init=True,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="segment_reuse"):
        LLM(model=str(folder), skip_tokenizer_init=True, segment_reuse=True)


def test_state_pages_come_back_from_the_cpu_tier_and_stay_per_tenant(arch_case):
    """With the device cache dropped, the shared prefix's KV and state come back from the CPU tier
    (same tokens and logits); another tenant's request with the same tokens hits nothing."""
    _, path, prompts, reference = arch_case
    llm = LLM(model=str(path), block_size=BLOCK, skip_tokenizer_init=True, mamba_cache_every=1,
              kv_cache_memory_bytes=16 << 20, cpu_cache_gb=0.05)
    outs, logits = run(llm, prompts[3:4])
    check(outs, logits, reference[3:4])
    llm.reset_prefix_cache()
    outs, logits = run(llm, prompts[4:])
    check(outs, logits, reference[4:])
    src = outs[0].metrics["cached_tokens_by_source"]
    assert src.get("cpu", 0) == 40 and src.get("device", 0) == 0, src
    other = llm.generate([{"prompt_token_ids": prompts[4]}], SamplingParams(temperature=0, max_tokens=NEW_TOKENS,
                         ignore_eos=True), use_tqdm=False, cache_salt="tenant-b")[0]
    assert other.num_cached_tokens == 0 and other.outputs[0].token_ids == reference[4][0]


def test_graph_state_metadata_matches_the_step_description_and_pads_safely():
    """The decode reads and writes a CUDA graph derives on the device from its static buffers
    (``graph_state_metadata``) give the mixer the same outputs and states as the host-built
    ``state_metadata``; padding rows (slot -1, stale tables) leave every block as it was."""
    from kvos.models.config import MambaShape
    from kvos.models.mamba import Mamba2Mixer
    from kvos.models.state import StateCache, graph_state_metadata, state_metadata

    torch.manual_seed(0)
    s = MambaShape(num_heads=4, head_dim=8, state_size=8, groups=2, conv_kernel=4)
    mixer = Mamba2Mixer(32, s)
    with torch.no_grad():
        for p in mixer.parameters():
            p.normal_(0, 0.3)

    def fresh():
        g = torch.Generator().manual_seed(3)
        return StateCache(torch.randn(8, s.conv_dim, s.conv_width, generator=g),
                          torch.randn(8, s.num_heads, s.head_dim, s.state_size, generator=g))

    bs, x = 4, torch.randn(3, 32)
    tables = [[0, 2, 5], [3, 0, 0], [7, 6, 0]]  # a decode at 9 (reads block 2 -> 5), one at 1, one crossing to 6
    starts = [8, 0, 4]
    eager, graph = fresh(), fresh()
    with torch.no_grad():
        ref = mixer(x, eager, state_metadata(bs, starts, [1, 1, 1], tables, 3))
        padded = torch.tensor(tables + [[5, 6, 7]], dtype=torch.int32)  # a stale padding row
        seq_lens = torch.tensor(starts + [9]) + 1
        slots = torch.tensor([0, 0, 0, -1])
        before = fresh()
        out = mixer(torch.cat([x, torch.randn(1, 32)]), graph, graph_state_metadata(padded, seq_lens, slots, bs))
    assert torch.allclose(out[:3], ref, atol=1e-6)
    assert torch.allclose(graph.conv, eager.conv, atol=1e-6) and torch.allclose(graph.ssm, eager.ssm, atol=1e-6)
    untouched = [0, 1, 2, 4]  # the padding row's stale blocks 5, 6, 7 are real rows' or unwritten
    assert torch.equal(graph.ssm[untouched], before.ssm[untouched])


def test_scan_constants_follow_an_in_place_weight_load():
    """The GPU prefill's float32 ``A = -exp(A_log)``, ``D`` and ``dt_bias`` are computed once per
    parameter version: a weight loaded in place afterwards gives the new values."""
    from kvos.models.config import MambaShape
    from kvos.models.mamba import Mamba2Mixer

    shape = MambaShape(num_heads=4, head_dim=4, state_size=8, groups=1, conv_kernel=4)
    mixer = Mamba2Mixer(16, shape).to(torch.bfloat16)
    A, D, bias = mixer._scan_constants()
    assert mixer._scan_constants()[0] is A  # cached
    with torch.no_grad():
        mixer.A_log.copy_(torch.arange(4.0))
        mixer.D.copy_(torch.full((4,), 2.0))
        mixer.dt_bias.copy_(torch.full((4,), -1.0))
    A, D, bias = mixer._scan_constants()
    assert A.dtype == D.dtype == bias.dtype == torch.float32
    assert torch.equal(A, -torch.exp(torch.arange(4.0))) and torch.equal(D, torch.full((4,), 2.0))
    assert torch.equal(bias, torch.full((4,), -1.0))
