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


@pytest.mark.parametrize("kv_transfer", ["p2p"])
def test_prefill_engine_hands_its_blocks_to_the_decode_engine(llm, kv_transfer):
    """Through ``DataParallelLLM`` (the blocking Python interface). ``p2p`` (the hand-over between
    Ray actors, on GPUs their default): the decode actor pulls the blocks from the prefill actor
    over gloo and writes them into its pool. ``auto`` on the CPU (host rows through Ray's object
    store into the decode engine's transfer tier) passes the same test; it is left out of the
    suite for time: host rows into the transfer tier are tested through the server
    (``test_disaggregated_server.py``)."""
    from kvos.distributed import DataParallelLLM

    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    refs = llm.generate(PROMPTS, sp, use_tqdm=False)
    landed = "transfer" if kv_transfer == "auto" else "device"  # where the moved blocks are found
    with DataParallelLLM(1, "kv_aware", prefill_engines=1, ray_address="local", num_blocks=128,
                         kv_transfer=kv_transfer, router_queue_weight=0.1) as dp:
        assert dp.engine.kv_transfer == ("host" if kv_transfer == "auto" else "p2p")
        assert dp.engine.router.queue_weight == dp.engine.prefill_router.queue_weight == 0.1
        outs = dp.generate(PROMPTS, sp)
        stats = dp.stats()
        blocks = 0
        for out, ref in zip(outs, refs):
            assert out.outputs[0].token_ids == ref.outputs[0].token_ids
            full = (len(ref.prompt_token_ids) - 1) // 16  # every full block but the last token's
            assert out.metrics["engine"] == 0  # the decode engine generated it
            by_source = out.metrics["cached_tokens_by_source"]
            assert by_source[landed] == sum(by_source.values()) == full * 16, by_source
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
    assert sum(by_source.values()) == full2 * 16, by_source
    if kv_transfer == "auto":
        assert by_source["device"] >= (len(refs[0].prompt_token_ids) - 1) // 16 * 16  # the first turn's
        assert moved * 16 == by_source["transfer"] > 0  # only the blocks the decode engine lacked moved
    else:
        assert by_source.get("transfer", 0) == 0 and 0 < moved < full2  # only the blocks the decode engine lacked moved
        assert stats["engines"][0]["p2p_received_bytes"] == blocks * llm.engine.runner.block_bytes
    assert [e["role"] for e in stats["engines"]] == ["decode", "prefill"]
    assert stats["engines"][1]["prefix_queries_tokens"] == sum(len(o.prompt_token_ids) for o in refs)
