"""Gemma 3 with images on a CUDA GPU (skipped without one), fp32: the Triton kernels, with the
chunks that hold an image attending through the masked reference, and decode in CUDA graphs give
transformers' greedy tokens and logits within 1e-3 of the largest (CPU reference), in one chunk
and in chunks of 6 tokens around images of 4."""
from __future__ import annotations

import pytest
import torch

from kvos import LLM
from tests.models.test_vision_language import BLOCK, check, image, img_part, user
from tests.support.vlm_checkpoints import write_checkpoint

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"), pytest.mark.gpu]


def test_images_on_the_gpu_match_transformers(tmp_path):
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    path = write_checkpoint(tmp_path / "vlm")
    vlm = (path, AutoProcessor.from_pretrained(path),
           Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval())
    a, b = image(3), image(4)
    messages = [user("the quick brown fox", img_part(a), "jumps over", img_part(b), "the lazy dog.")]
    for chunk in (2048, 6):
        llm = LLM(model=str(path), device="cuda", dtype="float32", block_size=BLOCK,
                  kv_cache_memory_bytes=8 << 20, max_num_batched_tokens=chunk)
        assert llm.engine.runner.graphs is not None
        check(vlm, llm, messages, [a, b])
        out = check(vlm, llm, messages, [a, b])  # again: the prefix cache holds both images' blocks
        assert out.num_cached_tokens > 0
