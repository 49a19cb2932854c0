"""The engine end to end on the default model: sampling, stops, n > 1, prefix hits, bad input."""
from __future__ import annotations

import pytest

from kvos import SamplingParams

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def gen(llm, prompt, **kw):
    return llm.generate([prompt], SamplingParams(**kw), use_tqdm=False)[0]


def test_generate_accepts_strings_and_token_ids(llm, tokenizer):
    ids = tokenizer("The capital of France is").input_ids
    a = llm.generate("The capital of France is", GREEDY, use_tqdm=False)[0]
    b = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)[0]
    assert a.prompt_token_ids == b.prompt_token_ids == ids
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert a.outputs[0].text == tokenizer.decode(a.outputs[0].token_ids, skip_special_tokens=True)
    assert "Paris" in a.outputs[0].text
    assert a.outputs[0].finish_reason == "length" and a.finished


def test_chat_applies_the_template(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason in ("stop", "length")


def test_chat_continues_the_final_message(llm, tokenizer):
    prefill = [{"role": "user", "content": "Count to ten."}, {"role": "assistant", "content": "1, 2, 3,"}]
    out = llm.chat(prefill, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False,
                   add_generation_prompt=False, continue_final_message=True)[0]
    text = tokenizer.apply_chat_template(prefill, tokenize=False, add_generation_prompt=False,
                                         continue_final_message=True)
    assert out.prompt_token_ids == tokenizer(text, add_special_tokens=False).input_ids
    assert out.outputs[0].text.lstrip().startswith("4")
    with pytest.raises(ValueError, match="^continue_final_message: "):
        llm.chat(prefill, use_tqdm=False, continue_final_message=True)  # a generation prompt after it
    with pytest.raises(ValueError, match="^chat_template_kwargs: may not set messages"):
        llm.chat(prefill[:1], use_tqdm=False, chat_template_kwargs={"messages": []})


def test_eos_stops_unless_ignored(llm):
    out = llm.chat([{"role": "user", "content": "Say hi."}], SamplingParams(temperature=0, max_tokens=200),
                   use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "stop" and len(out.outputs[0].token_ids) < 200


def test_max_tokens_and_stop_token_ids(llm):
    ref = gen(llm, "Count: 1, 2, 3,", temperature=0, max_tokens=10, ignore_eos=True).outputs[0]
    assert len(ref.token_ids) == 10
    stop_tok = ref.token_ids[4]
    first = ref.token_ids.index(stop_tok)
    out = gen(llm, "Count: 1, 2, 3,", temperature=0, max_tokens=10, stop_token_ids=[stop_tok]).outputs[0]
    assert out.token_ids == ref.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok


def test_stop_strings_truncate_text(llm):
    ref = gen(llm, "Count: 1, 2, 3,", temperature=0, max_tokens=16, ignore_eos=True).outputs[0]
    assert " 5" in ref.text
    out = gen(llm, "Count: 1, 2, 3,", temperature=0, max_tokens=16, stop=" 5").outputs[0]
    assert out.text == ref.text[: ref.text.index(" 5")]
    assert out.finish_reason == "stop" and out.stop_reason == " 5"
    kept = gen(llm, "Count: 1, 2, 3,", temperature=0, max_tokens=16, stop=[" 5"],
               include_stop_str_in_output=True).outputs[0]
    assert kept.text.endswith(" 5")


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm):
    sp = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate(["Once upon a time"], sp, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=0.8, max_tokens=20, ignore_eos=True)
    batch = llm.generate(["A list of fruits:", "Once upon a time", "def f(x):"], [others, sp, others],
                         use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    other_seed = gen(llm, "Once upon a time", temperature=1.0, seed=99, max_tokens=16, ignore_eos=True)
    assert other_seed.outputs[0].token_ids != alone


def test_top_k_one_and_tiny_min_p_window_equal_greedy(llm):
    greedy = gen(llm, "The sky is", temperature=0, max_tokens=10, ignore_eos=True).outputs[0].token_ids
    assert gen(llm, "The sky is", temperature=1.5, top_k=1, seed=1, max_tokens=10,
               ignore_eos=True).outputs[0].token_ids == greedy
    assert gen(llm, "The sky is", temperature=1.0, min_p=1.0, seed=2, max_tokens=10,
               ignore_eos=True).outputs[0].token_ids == greedy
    assert gen(llm, "The sky is", temperature=1.0, top_p=1e-6, seed=3, max_tokens=10,
               ignore_eos=True).outputs[0].token_ids == greedy


def test_logprobs(llm):
    out = gen(llm, "The capital of France is", temperature=0, max_tokens=5, logprobs=3).outputs[0]
    assert len(out.logprobs) == len(out.token_ids)
    for tok, entry in zip(out.token_ids, out.logprobs):
        assert tok in entry and len(entry) <= 4
        assert entry[tok] == max(entry.values())  # greedy picks the top token
        assert all(v <= 0 for v in entry.values())
    assert out.cumulative_logprob == pytest.approx(sum(e[t] for t, e in zip(out.token_ids, out.logprobs)))


def test_n_samples_share_the_prompt_with_copy_on_write(llm):
    before = llm.stats()["cow_copies"]
    sp = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    out = llm.generate(["Write a short poem about the sea:"], sp, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert all(len(c.token_ids) == 12 for c in out.outputs)
    assert llm.stats()["cow_copies"] > before  # the partial last prompt block was shared, then copied
    again = llm.generate(["Write a short poem about the sea:"], sp, use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    assert llm.stats()["used"] == 0


def test_shared_system_prompt_hits(llm, tokenizer):
    llm.reset_prefix_cache()
    system = [{"role": "system", "content": "You are kvos's helpful assistant. " * 20}]
    convs = [system + [{"role": "user", "content": q}] for q in ("Hi!", "What is 2+2?", "Name a colour.")]
    ids = [llm.chat_token_ids(c) for c in convs]
    common = 0
    while all(i[common] == ids[0][common] for i in ids):
        common += 1
    expected = common // 16 * 16
    before = llm.stats()
    first = llm.chat(convs[0], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    rest = llm.chat(convs[1:], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert [o.num_cached_tokens for o in rest] == [expected, expected]
    after = llm.stats()
    assert after["prefix_hits_tokens"] - before["prefix_hits_tokens"] == 2 * expected
    assert after["prefix_queries_tokens"] - before["prefix_queries_tokens"] == sum(map(len, ids))


def test_cache_salt_isolates_tenants(llm):
    llm.reset_prefix_cache()
    prompt = "Tenant data: " + "secret " * 60
    sp = SamplingParams(temperature=0, max_tokens=2)
    assert llm.generate([prompt], sp, use_tqdm=False, cache_salt="alice")[0].num_cached_tokens == 0
    assert llm.generate([prompt], sp, use_tqdm=False, cache_salt="bob")[0].num_cached_tokens == 0
    assert llm.generate([prompt], sp, use_tqdm=False, cache_salt="alice")[0].num_cached_tokens > 0


def test_priority_scheduling_preempts_the_least_important(make_llm):
    llm = make_llm(num_blocks=11, scheduling_policy="priority", max_num_seqs=8)
    prompts = [f"Story {i}: once upon a time there was a robot named R{i} who" for i in range(6)]
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)  # 3 blocks each, 10 usable
    outs = llm.generate(prompts, sp, use_tqdm=False, priority=[5, 0, 5, 1, 5, 2])
    assert llm.stats()["preemptions"] > 0
    first_done = sorted(range(6), key=lambda i: outs[i].metrics["finished_time"])
    assert set(first_done[:3]) == {1, 3, 5}
    ref = make_llm()
    assert [o.outputs[0].token_ids for o in outs] == [
        o.outputs[0].token_ids for o in ref.generate(prompts, sp, use_tqdm=False)]


def test_abort_frees_blocks_at_once(llm):
    eng = llm.engine
    rid = eng.add_request("Tell me a long story about dragons.", SamplingParams(max_tokens=200, ignore_eos=True))
    for _ in range(3):
        eng.step()
    assert llm.stats()["used"] > 0
    eng.abort_request(rid)
    assert llm.stats()["used"] == 0 and not eng.has_unfinished_requests()


def test_final_only_steps_return_each_finished_request_once_as_a_full_step_would(llm):
    """``step(final_only=True)`` (what ``LLM.generate`` uses) builds no output for a running
    request, and the finished ones equal those of plain steps."""
    eng = llm.engine

    def run(final_only: bool) -> list:
        ids = [eng.add_request("Count to ten.", SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
               for n in (2, 6)]
        outs = []
        while eng.has_unfinished_requests():
            outs += eng.step(final_only=final_only)
        return [o for o in outs if o.request_id in ids]

    plain, final = run(False), run(True)
    assert len(plain) > 2 and all(o.finished for o in final) and len(final) == 2
    assert [o.outputs[0].token_ids for o in final] == [o.outputs[0].token_ids for o in plain if o.finished]


@pytest.mark.parametrize("make_params, field", [
    (lambda: SamplingParams(max_tokens=0), "max_tokens"),
    (lambda: SamplingParams(temperature=-1), "temperature"),
    (lambda: SamplingParams(top_p=0), "top_p"),
    (lambda: SamplingParams(top_k=-5), "top_k"),
    (lambda: SamplingParams(min_p=2), "min_p"),
    (lambda: SamplingParams(n=0), "n"),
    (lambda: SamplingParams(stop=[""]), "stop"),
    (lambda: SamplingParams(logprobs=100), "logprobs"),
    # values the sampler or detokenizer cannot take: they failed inside a step before
    (lambda: SamplingParams(top_k=True), "^top_k"),
    (lambda: SamplingParams(logprobs=True), "^logprobs"),
    (lambda: SamplingParams(n=True), "^n "),
    (lambda: SamplingParams(skip_special_tokens=None), "^skip_special_tokens"),
    (lambda: SamplingParams(temperature=float("nan")), "^temperature"),
    (lambda: SamplingParams(stop=5), "^stop "),
    (lambda: SamplingParams(stop_token_ids=5), "^stop_token_ids"),
    (lambda: SamplingParams(prompt_logprobs=21), "^prompt_logprobs"),
])
def test_invalid_sampling_values_name_the_field(make_params, field):
    with pytest.raises(ValueError, match=field):
        make_params()


def test_values_checked_against_the_request_and_chat_text_parts(llm):
    """A priority list of the wrong length is refused before anything is queued (a stop token id
    past the vocabulary is not: it never matches, tests/serve/test_server_fields.py); a message's
    text parts are joined with newlines (as vLLM joins them)."""
    with pytest.raises(ValueError, match="^priority must be one per prompt"):
        llm.generate(["A", "B", "C"], SamplingParams(max_tokens=1), priority=[0], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    parts = [{"role": "user", "content": [{"type": "text", "text": "Name a"}, {"type": "text", "text": "colour."}]}]
    joined = [{"role": "user", "content": "Name a\ncolour."}]
    one = SamplingParams(max_tokens=1, temperature=0)
    assert (llm.chat(parts, one, use_tqdm=False)[0].prompt_token_ids
            == llm.chat(joined, one, use_tqdm=False)[0].prompt_token_ids)


def test_bad_requests_are_rejected_and_the_engine_keeps_serving(llm, tokenizer):
    eng = llm.engine
    ok = eng.add_request("The capital of France is", GREEDY)
    with pytest.raises(ValueError, match="prompt"):
        eng.add_request("", GREEDY)
    with pytest.raises(ValueError, match="prompt"):
        eng.add_request({"prompt_token_ids": [1] * eng.max_model_len}, GREEDY)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        eng.add_request({"prompt_token_ids": [10**9]}, GREEDY)
    with pytest.raises(ValueError, match="prompt"):
        eng.add_request("\x13", GREEDY)  # a string that encodes to no tokens
    with pytest.raises(ValueError, match="messages"):
        llm.chat([], GREEDY)
    with pytest.raises(ValueError, match="role"):
        llm.chat([{"role": "wizard", "content": "hi"}], GREEDY)
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            done[out.request_id] = out
    assert done[ok].outputs[0].finish_reason == "length"
    assert "Paris" in done[ok].outputs[0].text


def test_bad_model_paths(tmp_path, make_llm):
    with pytest.raises(ValueError, match="model"):
        make_llm(model=str(tmp_path / "missing.gguf"))
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(ValueError, match="model"):
        make_llm(model=str(corrupt))
    with pytest.raises(ValueError, match="block_size"):
        make_llm(block_size=0)


def test_a_request_outgrowing_the_whole_pool_ends_with_length(make_llm):
    llm = make_llm(num_blocks=5, block_size=16)  # 64 token slots in all
    out = llm.generate(["Write a very long essay about the history of computing."],
                       SamplingParams(temperature=0, max_tokens=200, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "length"
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) <= 64 + 1  # the last one needs no slot
    assert llm.stats()["used"] == 0
    again = llm.generate(["Hi"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert len(again.outputs[0].token_ids) == 4


def test_an_offline_eviction_policy_is_refused_before_the_model_loads():
    """``belady`` needs the simulator's oracle: an engine refuses it, naming the field."""
    from kvos.config import EngineConfig
    from kvos.engine.llm_engine import LLMEngine

    with pytest.raises(ValueError, match="eviction_policy 'belady'"):
        LLMEngine(EngineConfig(eviction_policy="belady"))


@pytest.mark.parametrize("value", [-1, 1.5, "512"])
def test_mixed_graph_tokens_must_be_a_non_negative_integer(value):
    from kvos.config import EngineConfig

    with pytest.raises(ValueError, match="mixed_graph_tokens"):
        EngineConfig(mixed_graph_tokens=value)
    assert EngineConfig(mixed_graph_tokens=0).mixed_graph_tokens == 0
