"""N-gram prompt lookup against a brute-force search, and the speculative config's errors."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvos.config import EngineConfig
from kvos.spec.config import SpeculativeConfig
from kvos.spec.ngram import NgramIndex, NgramProposer


def brute_force(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The latest earlier occurrence of the longest tail (max_n down to min_n tokens) that has a
    token after it; the k tokens that follow it."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        tail = tokens[-n:]
        for i in range(len(tokens) - n - 1, -1, -1):
            if tokens[i: i + n] == tail:
                return tokens[i + n: i + n + k]
    return []


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), min_size=1, max_size=60), k=st.integers(1, 6),
       min_n=st.integers(1, 3), extra=st.integers(0, 3), cut=st.integers(0, 60))
def test_index_matches_brute_force_as_the_sequence_grows(tokens, k, min_n, extra, cut):
    max_n = min_n + extra
    index = NgramIndex(min_n, max_n)
    cut = min(cut, len(tokens))
    if cut:  # the index sees a shorter sequence first, then the whole one (incremental updates)
        assert index.propose(tokens[:cut], k) == brute_force(tokens[:cut], k, min_n, max_n)
    assert index.propose(tokens, k) == brute_force(tokens, k, min_n, max_n)


def test_proposer_prefers_the_longest_match_and_forgets_finished_sequences():
    p = NgramProposer(3, 1, 3)
    # "5 6" is followed by 9 early on and by 7 later; the 3-gram "4 5 6" only by 1 2 3
    tokens = [4, 5, 6, 1, 2, 3, 0, 5, 6, 7, 8, 4, 5, 6]
    assert p.propose("a", tokens) == [1, 2, 3]
    assert p.propose("b", [5, 6, 7, 5, 6]) == [7, 5, 6]
    assert p.propose("c", [1, 2, 3]) == []
    assert len(p) == 3
    p.drop("a")
    assert len(p) == 2


@pytest.mark.parametrize("value, key", [
    ({"method": "eagle", "num_speculative_tokens": 3}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_spec_tokens": 3}, "num_spec_tokens"),
    ({"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"method": "ngram", "disable_by_batch_size": -1}, "disable_by_batch_size"),
    ({"num_speculative_tokens": 3}, "method"),
    ("{not json", "JSON"),
    ([1, 2], "JSON object"),
])
def test_bad_config_is_an_error_naming_the_key_before_any_engine_starts(value, key):
    with pytest.raises(ValueError, match=key):
        EngineConfig(speculative_config=value)


def test_config_from_json_text_and_one_lookup_bound():
    c = EngineConfig(speculative_config='{"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_max": 3}')
    assert c.speculative_config == SpeculativeConfig("ngram", 6, 2, 3)
    assert SpeculativeConfig.parse({"method": "ngram", "prompt_lookup_min": 5}).prompt_lookup_max == 5
