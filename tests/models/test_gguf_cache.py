"""The GGUF header and tokenizer cache (kvos.models.gguf_index): a second load parses neither the
header nor the tokenizer, and gives what parsing gives (weights, config, tokenizations, chat
template, special tokens); a changed file gets a new entry."""
from __future__ import annotations

import os

import numpy as np
import pytest

from kvos.models import gguf_header, gguf_index, gguf_loader
from kvos.models.loader import default_model_path

TEXTS = ["The capital of France is", "def quicksort(xs):\n    return xs", "héllo wörld ✓ 你好",
         "<|im_start|>user\nhi<|im_end|>", "  two  spaces\tand a tab\n\n"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"}, {"role": "user", "content": "and?"}]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVOS_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_second_load_reads_the_cache_and_equals_the_parsed_file(cache, monkeypatch):
    path = default_model_path()
    cfg, weights = gguf_loader.load_gguf(path)  # parses the header, writes the entry
    tok = gguf_index.cached_gguf_tokenizer(path)
    assert list((cache / "gguf").iterdir()) and list((cache / "tokenizers").iterdir())

    def forbidden(*args, **kwargs):
        raise AssertionError("parsed the GGUF file again")
    monkeypatch.setattr(gguf_header, "open_gguf", forbidden)
    import transformers.integrations.gguf as hf_gguf
    monkeypatch.setattr(hf_gguf, "get_gguf_tokenizer", forbidden)
    monkeypatch.setattr(hf_gguf, "read_gguf_metadata", forbidden)
    cfg2, weights2 = gguf_loader.load_gguf(path)
    assert cfg2 == cfg
    assert weights2.keys() == weights.keys()
    assert all(np.array_equal(weights[k], weights2[k]) for k in weights)
    tok2 = gguf_index.cached_gguf_tokenizer(path)
    assert len(tok2) == len(tok)
    for text in TEXTS:
        assert tok2(text).input_ids == tok(text).input_ids, text
    assert tok2.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True) == \
        tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert (tok2.eos_token_id, tok2.bos_token_id, tok2.all_special_ids) == \
        (tok.eos_token_id, tok.bos_token_id, tok.all_special_ids)


def test_a_changed_file_gets_a_new_entry(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"x" * 10)
    before = gguf_index._key(f, "code")
    os.utime(f, ns=(1, 1))
    assert gguf_index._key(f, "code") != before
    f.write_bytes(b"x" * 11)
    assert gguf_index._key(f, "code") != gguf_index._key(f, "other code")
