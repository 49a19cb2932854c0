"""Mamba hybrids on a CUDA GPU (skipped without one), fp32: Bamba and Granite 4.0-H (its experts
run without graphs) tiny
checkpoints give the CPU path's greedy tokens and logits (within 1e-3 of the largest; the CPU
path is the one tested against transformers in ``test_hybrid_models.py``) with decode steps in
CUDA graphs, where each graph derives its state reads and writes on the device, and without
graphs (``enforce_eager``), prefix hits restoring state in both."""
from __future__ import annotations

import pytest
import torch

from kvos import LLM
from tests.support.hybrid_checkpoints import VOCAB, write_checkpoint

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"), pytest.mark.gpu]


@pytest.mark.parametrize("arch", ["bamba", "granite"])
def test_graph_decode_matches_the_cpu_path(arch, tmp_path):
    from tests.models.test_hybrid_models import check, run

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    path = write_checkpoint(arch, tmp_path / arch)
    gen = torch.Generator().manual_seed(2)
    shared = torch.randint(3, VOCAB, (41,), generator=gen).tolist()
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (1, 29, 70)] + [shared + [4], shared]
    common = dict(block_size=4, skip_tokenizer_init=True, mamba_cache_every=1, kv_cache_memory_bytes=64 << 20)
    cpu, cpu_logits = run(LLM(model=str(path), device="cpu", **common), prompts)
    reference = [(o.outputs[0].token_ids, cpu_logits[o.request_id]) for o in cpu]
    for eager in (False, True):
        llm = LLM(model=str(path), device="cuda", dtype="float32", enforce_eager=eager, **common)
        assert (llm.engine.runner.graphs is None) == (eager or arch == "granite")  # no graphs with experts
        for _ in range(2):  # the second pass restores every prompt's state from the prefix cache
            outs, logits = run(llm, prompts)
            check(outs, {k: [r.cpu() for r in v] for k, v in logits.items()}, reference)
        assert sum(o.num_cached_tokens for o in outs) > 0
