"""Mamba hybrids on a CUDA GPU (skipped without one), fp32: Bamba and Granite 4.0-H tiny
checkpoints give transformers' greedy tokens (logits within 1e-3 of the largest) with decode
steps in CUDA graphs, where each graph derives its state reads and writes on the device, and the
same as without graphs (``enforce_eager``) with prefix hits restoring state."""
from __future__ import annotations

import pytest
import torch

from kvos import LLM
from tests.support.hybrid_checkpoints import VOCAB, write_checkpoint

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"), pytest.mark.gpu]


@pytest.mark.parametrize("arch", ["bamba", "granite"])
def test_graph_decode_matches_transformers(arch, tmp_path):
    from transformers import AutoModelForCausalLM

    from tests.models.test_hybrid_models import check, hf_generate, run

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    path = write_checkpoint(arch, tmp_path / arch)
    gen = torch.Generator().manual_seed(2)
    shared = torch.randint(3, VOCAB, (41,), generator=gen).tolist()
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (3, 29, 70)] + [shared + [4], shared]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    reference = [hf_generate(hf, p) for p in prompts]
    outs = {}
    for eager in (False, True):
        llm = LLM(model=str(path), device="cuda", dtype="float32", block_size=4, skip_tokenizer_init=True,
                  mamba_cache_every=1, kv_cache_memory_bytes=64 << 20, enforce_eager=eager)
        assert (llm.engine.runner.graphs is None) == eager
        for _ in range(2):  # the second pass restores every prompt's state from the prefix cache
            o, logits = run(llm, prompts)
            check(o, logits, reference)
        assert sum(x.num_cached_tokens for x in o) > 0
        outs[eager] = [x.outputs[0].token_ids for x in o]
    assert outs[False] == outs[True]
