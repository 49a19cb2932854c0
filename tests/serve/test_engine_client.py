"""The server takes any ``EngineClient``: the in-process engine is one, a bare ``LLMEngine`` is
not (the server never duck-types what it is given)."""
from __future__ import annotations

from kvos.engine.async_engine import AsyncEngine
from kvos.engine.client import EngineClient, EngineHealth, ModelFacts


def test_the_in_process_engine_is_an_engine_client(llm):
    engine = llm.engine
    client = AsyncEngine(engine)  # not started: no thread drives the shared engine
    assert isinstance(client, EngineClient)
    assert not isinstance(engine, EngineClient)
    assert client.tokenizer is engine.tokenizer
    assert client.model_facts == ModelFacts(engine.kv.model_id, engine.max_model_len, engine.model_config.vocab_size,
                                            engine.config.dtype, engine.config.device)
    assert client.health() == EngineHealth() and client.health().serving
    assert client.stats()["num_blocks"] == engine.stats()["num_blocks"]


def test_health_reports_only_the_counts_a_client_knows():
    assert EngineHealth().json() == {}
    assert EngineHealth(2).json() == {"engines_up": 2}
    assert EngineHealth(1, 0).json() == {"engines_up": 1, "prefill_engines_up": 0}
    assert EngineHealth(1, 0).serving and not EngineHealth(0, 1).serving


def test_waiting_never_counts_a_sequence_twice_while_the_loop_is_behind(make_llm):
    """The engine thread takes six requests while the event loop is busy (their acceptances not
    yet delivered): the scheduler's waiting plus the client's queued still add up to at most six,
    and to six once the loop catches up."""
    import asyncio
    import time

    from kvos import SamplingParams

    client = AsyncEngine(make_llm(max_num_seqs=2, kv_cache_memory_bytes=16 << 20).engine)
    client.start()
    params = SamplingParams(max_tokens=4, ignore_eos=True, n=1)

    def in_flight() -> int:
        s = client.stats()
        return s["running"] + s["waiting"] + client.num_queued

    async def main() -> tuple[int, int, int]:
        tasks = [asyncio.create_task(client.submit("Count slowly:", params, f"r{i}")) for i in range(6)]
        await asyncio.sleep(0)  # every submit is now on the engine thread's queue
        queued = client.num_queued
        end = time.monotonic() + 30
        while client.stats()["running"] + client.stats()["waiting"] < 2 and time.monotonic() < end:
            time.sleep(0.001)  # the loop stays blocked: no acceptance is delivered
        behind = in_flight()
        streams = await asyncio.gather(*tasks)
        for stream in streams:
            async for _ in stream:
                pass
        return queued, behind, client.num_queued

    try:
        queued, behind, after = asyncio.run(main())
    finally:
        client.shutdown()
    assert queued == 6 and behind <= 6 and after == 0
