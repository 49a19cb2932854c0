"""The GPU code path (Triton attention backend and fused kernels) driving the real engine, run
on the CPU under Triton's interpreter: greedy tokens equal the torch path's on the same random
weights, through chunked prefill, prefix-cache hits and mixed decode/prefill steps."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # must be set before triton is first imported in this process
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")
pytestmark = [pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter run is for CPU-only machines"), pytest.mark.slow]


@pytest.mark.parametrize("config, kv_cache_dtype", [("qwen3-tiny", "auto"), ("llama-tiny", "int8")])
def test_triton_path_matches_torch_path(monkeypatch, config, kv_cache_dtype):
    """int8 KV: the write kernel quantizes as the torch path does (bit for bit) and the attention
    kernels dequantize inside. (fp8 writes need a GPU: Triton 3.6's interpreter casts fp32 to
    fp8 wrongly; the kernel tests cover fp8 attention on the CPU.)"""
    from kvos import LLM, SamplingParams
    from kvos.models import ops
    from kvos.worker.triton_attention import TritonBackend

    kw = dict(model=config, random_weights=True, num_blocks=64, max_num_batched_tokens=24, max_num_seqs=4,
              kv_cache_dtype=kv_cache_dtype)
    g = torch.Generator().manual_seed(4)
    shared = torch.randint(3, 4096, (20,), generator=g).tolist()
    # 21, 26 and 44 tokens: a 24-token budget chunks the 26 and the 44 (the 44 over two steps
    # that also decode the others); the first 16 tokens are one shared full block
    prompts = [shared + torch.randint(3, 4096, (n,), generator=g).tolist() for n in (1, 6, 24)]
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)  # a prefill token, two decodes
    ref = LLM(**kw).generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)

    llm = LLM(**kw)
    llm.engine.runner.backend = TritonBackend()
    monkeypatch.setattr(ops, "use_kernels", lambda x: True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    outs += llm.generate([{"prompt_token_ids": prompts[2]}], sp, use_tqdm=False)  # a prefix-cache hit
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref + ref[2:]]
    assert outs[-1].num_cached_tokens > 0
