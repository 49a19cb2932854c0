"""The data-parallel front end (here one engine in a process of its own, ``--transport process``)
is an ``EngineClient``, with the facts of the model its engine loaded."""
from __future__ import annotations

import pytest

from kvos.distributed import DataParallelEngine
from kvos.engine.client import EngineClient, EngineHealth

pytestmark = pytest.mark.slow


def test_the_data_parallel_front_end_is_an_engine_client(llm):
    front = DataParallelEngine({"max_model_len": 1024, "num_blocks": 64}, 1, transport="process")
    try:
        assert isinstance(front, EngineClient)
        facts = front.model_facts
        assert (facts.model_id, facts.max_model_len, facts.vocab_size) == (
            llm.engine.kv.model_id, 1024, llm.engine.model_config.vocab_size)
        assert front.tokenizer is not None and front.tokenizer.encode("Hello") == llm.get_tokenizer().encode("Hello")
        assert front.health() == EngineHealth(engines_up=1)
        assert front.stats()["engines"][0]["up"]
    finally:
        front.shutdown()
