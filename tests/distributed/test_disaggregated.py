"""Disaggregated prefill on CPU: one prefill and one decode engine (Ray actors of the default
model); the prompt's KV blocks move from one process to the other."""
from __future__ import annotations

import pytest

from kvos import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.ray]

pytest.importorskip("ray")

PROMPTS = [f"Document {i}: " + "The page table maps virtual pages to physical frames. " * (6 + i)
           + "Summarize the document." for i in range(3)]


def test_the_tier_offload_is_a_kv_connector(make_llm):
    from kvos.scheduler.connector import KVConnectorScheduler, KVConnectorWorker

    offload = make_llm(num_blocks=32, kv_transfer_gb=0.01).engine.offload
    assert isinstance(offload, KVConnectorScheduler) and isinstance(offload.tier_io, KVConnectorWorker)
    assert [t.name for t in offload.h.tiers] == ["transfer"] and offload.cpu is None


def test_prefill_engine_hands_its_blocks_to_the_decode_engine(llm):
    """Through ``DataParallelLLM`` (the blocking Python interface)."""
    from kvos.distributed import DataParallelLLM

    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    refs = llm.generate(PROMPTS, sp, use_tqdm=False)
    with DataParallelLLM(1, "kv_aware", prefill_engines=1, ray_address="local", num_blocks=128) as dp:
        outs = dp.generate(PROMPTS, sp)
        stats = dp.stats()
        blocks = 0
        for out, ref in zip(outs, refs):
            assert out.outputs[0].token_ids == ref.outputs[0].token_ids
            full = (len(ref.prompt_token_ids) - 1) // 16  # every full block but the last token's
            assert out.metrics["engine"] == 0  # the decode engine generated it
            assert out.metrics["cached_tokens_by_source"] == {"device": 0, "transfer": full * 16}
            assert out.num_cached_tokens == full * 16
            blocks += full
        r = stats["router"]
        assert r["prefills"] == 3 and r["transferred_blocks"] == blocks
        # a later turn: the decode engine holds the first turn's blocks, so only the new ones move
        follow = PROMPTS[0] + refs[0].outputs[0].text + " Now give three examples of a page table walk." * 4
        ref2 = llm.generate([follow], sp, use_tqdm=False)[0]
        out2 = dp.generate([follow], sp)[0]
        moved = dp.stats()["router"]["transferred_blocks"] - blocks
    full2 = (len(ref2.prompt_token_ids) - 1) // 16
    assert out2.outputs[0].token_ids == ref2.outputs[0].token_ids
    by_source = out2.metrics["cached_tokens_by_source"]
    assert by_source["device"] >= (len(refs[0].prompt_token_ids) - 1) // 16 * 16  # the first turn's
    assert by_source["device"] + by_source["transfer"] == full2 * 16, by_source
    assert moved * 16 == by_source["transfer"] > 0  # only the blocks the decode engine lacked moved
    assert [e["role"] for e in stats["engines"]] == ["decode", "prefill"]
    assert stats["engines"][1]["prefix_queries_tokens"] == sum(len(o.prompt_token_ids) for o in refs)
