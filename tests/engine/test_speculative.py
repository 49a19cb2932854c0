"""Speculative decoding on the real model (CPU): greedy outputs equal plain decoding's and
transformers' whatever the cache does (prefix hits, chunked prefill, preemption by recompute and
by swap, n > 1); seeded sampling reproduces; requests that opt out, and batches above
``disable_by_batch_size``, do not speculate; the stats count what happened."""
from __future__ import annotations

import pytest

from kvos import SamplingParams
from tests.support.hf_reference import hf_greedy
from tests.support.speculative import CODE, FREE, QUOTE, plain_tokens, tokens

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def spec_llm(make_llm):
    return make_llm(kv_cache_memory_bytes=64 << 20, speculative_config=NGRAM)


def test_greedy_equals_plain_decoding_and_transformers(llm, spec_llm, hf_model):
    prompts = [QUOTE, CODE, FREE]
    plain = plain_tokens(llm, prompts, GREEDY)
    before = spec_llm.engine.spec_stats.accepted
    spec = tokens(spec_llm.generate(prompts, GREEDY, use_tqdm=False))
    assert spec == plain
    ids = spec_llm.get_tokenizer()(QUOTE).input_ids
    assert spec[0] == hf_greedy(hf_model, list(ids), GREEDY.max_tokens)[0]
    assert spec_llm.engine.spec_stats.accepted > before + 20  # the quoting prompt's drafts were accepted
    again = tokens(spec_llm.generate([QUOTE], GREEDY, use_tqdm=False))  # a prefix hit this time
    assert again[0] == plain[0]
    assert spec_llm.engine.kv.counters.prefix_hits_tokens > 0


@pytest.mark.parametrize("case", ["chunked_prefill", "recompute", "swap", "n2"])
def test_greedy_equality_under_the_cache_s_pressures(llm, make_llm, spec_llm, case):
    kw = {"speculative_config": NGRAM, "kv_cache_memory_bytes": 64 << 20}
    params = GREEDY
    prompts = [QUOTE, CODE]
    if case == "chunked_prefill":
        kw["max_num_batched_tokens"] = 24
    elif case in ("recompute", "swap"):  # a pool too small for all four at once: some are preempted
        kw.update(num_blocks=24, block_size=8, preemption_mode=case, swap_space_gb=0.05)
        prompts = [QUOTE, CODE, QUOTE + " the", CODE + "    "]
    else:
        params = SamplingParams(temperature=0, max_tokens=GREEDY.max_tokens, ignore_eos=True, n=2)
    eng = spec_llm if case == "n2" else make_llm(**kw)
    before = eng.engine.spec_stats.accepted
    assert tokens(eng.generate(prompts, params, use_tqdm=False)) == plain_tokens(llm, prompts, params)
    assert eng.engine.spec_stats.accepted > before
    if case in ("recompute", "swap"):
        assert eng.engine.kv.counters.preemptions > 0
    if case == "swap":
        assert eng.engine.kv.counters.swapped_out_blocks > 0


def test_seeded_sampling_reproduces_and_opting_out_skips_speculation(spec_llm):
    sp = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=16, ignore_eos=True)
    a = tokens(spec_llm.generate([QUOTE], sp, use_tqdm=False))
    b = tokens(spec_llm.generate([QUOTE, FREE], [sp, SamplingParams(temperature=1.0, max_tokens=10)],
                                 use_tqdm=False))
    assert a[0] == b[0]
    stats = spec_llm.engine.spec_stats
    before = stats.verified_seqs
    off = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, speculative=False)
    spec_llm.generate([QUOTE], off, use_tqdm=False)
    assert stats.verified_seqs == before
    with pytest.raises(ValueError, match="speculative"):
        SamplingParams(speculative="no")


def test_load_awareness_turns_speculation_off_above_the_batch_limit(llm, make_llm):
    eng = make_llm(kv_cache_memory_bytes=64 << 20, speculative_config={**NGRAM, "disable_by_batch_size": 1})
    prompts = [QUOTE, CODE, QUOTE + " the", CODE + "    "]
    params = GREEDY
    assert tokens(eng.generate(prompts, params, use_tqdm=False)) == plain_tokens(llm, prompts, params)
    stats = eng.engine.stats()["speculative"]
    assert stats["skipped_for_load"] > 0 and stats["verify_steps"] == 0
    one = tokens(eng.generate([QUOTE], params, use_tqdm=False))  # alone: it speculates
    assert eng.engine.stats()["speculative"]["verify_steps"] > 0 and one == plain_tokens(llm, [QUOTE], params)


def test_stop_strings_end_a_verify_step_where_plain_decoding_stops(llm, spec_llm):
    """A verify step may yield tokens past a stop string: they are dropped, so text, token ids and
    finish reason are plain decoding's."""
    plain = llm.generate([QUOTE], GREEDY, use_tqdm=False)[0].outputs[0]
    words = plain.text.split()
    stop = " ".join(words[5:7])  # a stop string in the middle of a run of accepted drafts
    sp = SamplingParams(temperature=0, max_tokens=GREEDY.max_tokens, ignore_eos=True, stop=[stop])
    a = llm.generate([QUOTE], sp, use_tqdm=False)[0].outputs[0]
    before = spec_llm.engine.spec_stats.accepted
    b = spec_llm.generate([QUOTE], sp, use_tqdm=False)[0].outputs[0]
    assert spec_llm.engine.spec_stats.accepted > before
    assert (b.text, list(b.token_ids), b.finish_reason, b.stop_reason) == (a.text, list(a.token_ids), "stop", stop)
