"""Incremental detokenization against the tokenizer's own decode of the whole output (the reference):
fed one token at a time, the streamed text only ever grows, never ends in a broken character, and
ends equal to the whole decode; stop strings cut where a search of the whole decode would."""
from __future__ import annotations

import random

import pytest

from kvos import SamplingParams
from kvos.engine.detokenizer import IncrementalDetokenizer

TEXTS = ["Hello, world! The café serves crème brûlée. 東京は日本の首都です。 🚀🎉 done.",
         "def f(x):\n    return x ** 2  # ünïcödé\n\n\ttabs and  double  spaces",
         "Emoji sequences: 👩‍👩‍👧‍👦 🇫🇷 and math ∑∫√∞, arrows → ⇒, and Ελληνικά."]


def stream(tok, ids: list[int], params: SamplingParams) -> tuple[list[str], str | None, str]:
    d = IncrementalDetokenizer(tok, params)
    texts, stop = [], None
    for n in range(1, len(ids) + 1):
        stop = d.update(ids[:n])
        texts.append(d.text)
        if stop is not None:
            break
    if stop is None:
        d.flush()
    return texts, stop, d.text


@pytest.fixture(scope="module")
def gemma_tokenizer(gemma_path):
    from kvos.models.loader import load_tokenizer

    return load_tokenizer(gemma_path)


@pytest.mark.parametrize("which", ["smollm2", "gemma"])
def test_streamed_text_equals_the_whole_decode(request, which):
    """Byte-level BPE (SmolLM2) and a SentencePiece-style vocabulary with byte fallback (Gemma 3)."""
    tokenizer = request.getfixturevalue("tokenizer" if which == "smollm2" else "gemma_tokenizer")
    rng = random.Random(0)
    pieces = [tokenizer(t, add_special_tokens=False).input_ids for t in TEXTS]
    cases = pieces + [sum(rng.sample(pieces, len(pieces)), []) for _ in range(5)]
    for ids in cases:
        texts, stop, final = stream(tokenizer, ids, SamplingParams())
        assert final == tokenizer.decode(ids, skip_special_tokens=True)
        for a, b in zip(texts, texts[1:]):
            assert b.startswith(a)  # a streamed delta is never revised
        assert all(not t.endswith("\ufffd") for t in texts[:-1])


def test_random_ids_stream_never_revises(tokenizer):
    rng = random.Random(1)
    for _ in range(20):
        ids = [rng.randrange(len(tokenizer)) for _ in range(60)]
        texts, _, final = stream(tokenizer, ids, SamplingParams())
        for a, b in zip(texts + [final], texts[1:] + [final]):
            assert b.startswith(a)


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_cut_as_the_whole_decode_would(tokenizer, include):
    ids = tokenizer(TEXTS[0], add_special_tokens=False).input_ids
    whole = tokenizer.decode(ids)
    for stop in ("brûlée", "東京", "🎉", "café serves"):
        texts, got, final = stream(tokenizer, ids, SamplingParams(stop=[stop], include_stop_str_in_output=include))
        assert got == stop
        i = whole.index(stop)
        assert final == (whole[: i + len(stop)] if include else whole[:i])
        assert all(stop not in t or include for t in texts)
