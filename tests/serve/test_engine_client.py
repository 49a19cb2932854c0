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
