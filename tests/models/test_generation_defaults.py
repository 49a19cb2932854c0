"""A model's recommended sampling values (generation_config) and the operator's override."""
from __future__ import annotations

import json

import pytest

from kvos.config import EngineConfig
from kvos.models.generation_defaults import model_sampling_defaults
from kvos.models.loader import default_model_path


def test_folder_generation_config_keeps_only_sampling_keys(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 99, "bos_token_id": 1, "do_sample": True}))
    assert model_sampling_defaults(tmp_path) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False, "top_p": 0.9}))
    assert model_sampling_defaults(tmp_path) == {"top_p": 0.9, "temperature": 0.0}
    assert model_sampling_defaults(tmp_path / "missing") == {}


def test_gguf_files_take_their_release_s_values():
    assert model_sampling_defaults(default_model_path()) == {"temperature": 0.2, "top_p": 0.9}
    assert model_sampling_defaults(default_model_path().parent / "unknown-model.Q4_0.gguf") == {}


@pytest.mark.parametrize("value, key", [
    ('{"temperature": -1}', "temperature"), ('{"max_tokens": 5}', "max_tokens"), ('{"top_p": "high"}', "top_p"),
    ("nope", "JSON"),
])
def test_a_bad_override_names_its_key(value, key):
    with pytest.raises(ValueError, match=key):
        EngineConfig(override_generation_config=value)
    with pytest.raises(ValueError, match="generation_config"):
        EngineConfig(generation_config="hf")


def test_engine_defaults_are_the_model_s_then_the_override(make_llm):
    llm = make_llm(kv_cache_memory_bytes=32 << 20, override_generation_config={"temperature": 0.5, "min_p": 0.1})
    assert llm.engine.default_sampling == {"temperature": 0.5, "top_p": 0.9, "min_p": 0.1}
    sp = llm.get_default_sampling_params()
    assert (sp.temperature, sp.top_p, sp.min_p) == (0.5, 0.9, 0.1)
    plain = make_llm(kv_cache_memory_bytes=32 << 20, generation_config="kvos")
    assert plain.engine.default_sampling == {}
