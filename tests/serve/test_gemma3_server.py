"""``kvos serve --model gemma-3-270m``: the hybrid model behind the OpenAI server, with the real
openai client; per-group KV metrics on /metrics."""
from __future__ import annotations

import openai
import pytest

from tests.support.hf_reference import hf_greedy
from tests.support.server import Server

pytestmark = pytest.mark.slow

PROMPT = ("The river carries leaves toward the sea, and the committee records every item in its "
          "ledger before the evening bell rings over the old town square, where the merchants fold "
          "their tents. The capital of France is")


def test_gemma_completions_and_group_metrics(gemma_path):
    """The reference is transformers' Gemma 3 on kvos's loaded weights (tests/models/
    test_gemma3_model.py holds those against transformers' own load of the GGUF)."""
    from kvos import LLM
    from kvos.models.hf_bridge import hf_model_sharing_weights

    local = LLM(model=str(gemma_path), kv_cache_memory_bytes=16 << 20)
    tok = local.get_tokenizer()
    ids = tok(PROMPT).input_ids
    assert len(ids) > 32  # two full blocks: both groups cache something
    ref = tok.decode(hf_greedy(hf_model_sharing_weights(local.engine.runner.model).eval(), ids, 8)[0])
    del local
    server = Server("--model", "gemma-3-270m", "--kv-cache-memory-bytes", str(64 << 20)).wait_ready(timeout=300)
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        assert "/v1/completions -H" in server.output()  # the banner shows a base model's call
        (model,) = [m.id for m in client.models.list().data]
        r = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
        assert r.choices[0].text == ref and r.usage.completion_tokens == 8
        again = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
        assert again.choices[0].text == ref and again.usage.prompt_tokens_details.cached_tokens == (len(ids) - 1) // 16 * 16
        with pytest.raises(openai.BadRequestError, match="no chat template"):  # a base model
            client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}])
        for group, kind in (("0", "full_attention"), ("1", "sliding_window")):
            assert server.metric("kvos:kv_cache_group_blocks", f'group="{group}",kind="{kind}",state="cached"') > 0
            assert server.metric("kvos:kv_cache_group_blocks", f'group="{group}",kind="{kind}",state="used"') == 0
        assert server.metric("kvos:kv_cache_waste_perc") == 0  # nothing running
    finally:
        server.stop()
