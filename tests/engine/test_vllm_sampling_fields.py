"""vLLM's ``allowed_token_ids``, ``bad_words`` and ``truncate_prompt_tokens``, and ``min_tokens``
holding back stop strings: greedy output checked against transformers' ``generate`` (its
``bad_words_ids`` and ``prefix_allowed_tokens_fn``), a plain per-row reference, and requests
that need no new field."""
from __future__ import annotations

import pytest
import torch

from kvos import SamplingParams
from kvos.engine.detokenizer import IncrementalDetokenizer
from kvos.engine.llm_engine import truncate_prompt
from kvos.scheduler.describe import bad_word_bans
from kvos.worker.sampler import Sampler, SampleRow, adjust_logits

POEM = "Write a poem about the sea:"
FRANCE = "The capital of France is"
N = 12


@pytest.fixture(scope="module")
def async_llm(make_llm):
    """Async scheduling (off on the CPU by default): the token the step in flight samples is not
    on the host yet, so a bad word whose prefix ends with it is banned on the device."""
    llm = make_llm(async_scheduling=True)
    assert llm.engine.async_scheduling
    return llm


@torch.inference_mode()
def hf_greedy(hf_model, tokenizer, prompt: str, **kw) -> list[int]:
    ids = tokenizer(prompt).input_ids
    out = hf_model.generate(torch.tensor([ids]), max_new_tokens=N, min_new_tokens=N, do_sample=False,
                            pad_token_id=0, **kw)
    return out[0, len(ids):].tolist()


def greedy(llm, prompts: list[str], **kw) -> list[list[int]]:
    sp = SamplingParams(temperature=0, max_tokens=N, min_tokens=N, **kw)  # min_tokens: no EOS, as HF's
    return [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]


@pytest.mark.parametrize("kw, field", [
    (dict(allowed_token_ids=[]), "allowed_token_ids"), (dict(allowed_token_ids=[-1]), "allowed_token_ids"),
    (dict(allowed_token_ids=[True]), "allowed_token_ids"), (dict(allowed_token_ids=3), "allowed_token_ids"),
    (dict(bad_words="sea"), "bad_words"), (dict(bad_words=[""]), "bad_words"), (dict(bad_words=["  "]), "bad_words"),
    (dict(bad_words=[3]), "bad_words"), (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
    (dict(truncate_prompt_tokens=True), "truncate_prompt_tokens"), (dict(truncate_prompt_tokens=2.0),
                                                                    "truncate_prompt_tokens"),
])
def test_invalid_values_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)


def test_flags_and_vocabulary_checks(llm):
    for kw in (dict(allowed_token_ids=[5]), dict(bad_words=["sea"])):
        sp = SamplingParams(**kw)
        assert sp.adjusts_logits and not sp.can_speculate, kw
    sp = SamplingParams(bad_words=[], truncate_prompt_tokens=4)
    assert not sp.adjusts_logits and sp.can_speculate
    with pytest.raises(ValueError, match="allowed_token_ids"):
        llm.generate(["hi"], SamplingParams(allowed_token_ids=[1, 10**7]), use_tqdm=False)
    assert llm.generate(["hi"], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


def test_bad_words_tokenize_as_vllm_does(tokenizer):
    """A word alone and after a space; the spaced form only where it is as many tokens ("wonder"
    is two tokens alone, one after a space: vLLM keeps the bare form only)."""
    def enc(s):
        return tokenizer.encode(s, add_special_tokens=False)

    sp = SamplingParams(bad_words=["The sea", " wonder"])
    sp.update_from_tokenizer(tokenizer)
    assert len(enc("wonder")) == 2 and len(enc(" wonder")) == 1
    assert sp.bad_words_token_ids == [enc("The sea"), enc(" The sea"), enc("wonder")]


def test_bad_word_bans_with_and_without_a_pending_token():
    words = [[7], [1, 2], [3, 4, 5]]
    assert bad_word_bans(words, [], 0) == ([7], [])
    assert bad_word_bans(words, [9, 1], 0) == ([7, 2], [])
    assert bad_word_bans(words, [3, 4], 0) == ([7, 5], [])
    assert bad_word_bans(words, [4], 0) == ([7], [])
    # one generated token still on the device: each ban waits on it being the prefix's last token
    assert bad_word_bans(words, [], 1) == ([7], [(2, 1)])
    assert bad_word_bans(words, [3], 1) == ([7], [(2, 1), (5, 4)])
    assert bad_word_bans(words, [8], 1) == ([7], [(2, 1)])


@pytest.mark.parametrize("async_on", [False, True], ids=["sync", "async"])
def test_bad_words_match_transformers(request, tokenizer, hf_model, async_on):
    """Greedy with bad words equals transformers' greedy with ``bad_words_ids`` (the same
    sequences), in one batch with a plain request; each ban changes the output."""
    llm = request.getfixturevalue("async_llm" if async_on else "llm")
    cases = [["The sea"], ["sea is", "wonder"]]  # a word after the first token; one after a prefix
    plain = greedy(llm, [POEM])[0]
    for words in cases:
        sp = SamplingParams(temperature=0, max_tokens=N, min_tokens=N, bad_words=words)
        outs = llm.generate([POEM, POEM], [sp, SamplingParams(temperature=0, max_tokens=N, min_tokens=N)],
                            use_tqdm=False)
        got = outs[0].outputs[0].token_ids
        assert outs[1].outputs[0].token_ids == plain
        assert got == hf_greedy(hf_model, tokenizer, POEM, bad_words_ids=sp.bad_words_token_ids), words
        assert got != plain, words
        for seq in sp.bad_words_token_ids:
            assert not any(got[i: i + len(seq)] == seq for i in range(len(got))), (words, seq)


def test_allowed_token_ids_match_transformers(llm, tokenizer, hf_model):
    allowed = [tokenizer.encode(w)[0] for w in [" the", " city", " of", " light", " Paris", ".", " is", " a"]]
    got = greedy(llm, [FRANCE], allowed_token_ids=allowed)[0]
    assert got == hf_greedy(hf_model, tokenizer, FRANCE, prefix_allowed_tokens_fn=lambda b, ids: allowed)
    assert got != greedy(llm, [FRANCE])[0] and set(got) <= set(allowed)
    sampled = llm.generate([FRANCE, POEM], [SamplingParams(temperature=1.5, seed=3, n=3, max_tokens=N,
                                                           allowed_token_ids=allowed),
                                            SamplingParams(temperature=0, max_tokens=N)], use_tqdm=False)
    assert all(set(c.token_ids) <= set(allowed) for c in sampled[0].outputs)
    assert sampled[1].outputs[0].token_ids == greedy(llm, [POEM])[0][: len(sampled[1].outputs[0].token_ids)]


def test_adjustment_equals_the_per_row_reference():
    """Allowed ids and bans on the pending token next to bias, in one batch, against plain row ops."""
    V = 300
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(1)) * 3
    prev = torch.tensor([11, 42])  # the previous launch's device tokens
    rows = [SampleRow(0, SamplingParams(temperature=0, allowed_token_ids=[3, 17, 250], logit_bias={17: -50})),
            SampleRow(1, SamplingParams(temperature=0)),
            SampleRow(2, SamplingParams(temperature=0, bad_words=["x"]), pending_src=0,
                      ban_after=[(5, 11), (6, 12), (5, 11)], ban_ids=[9]),
            SampleRow(3, SamplingParams(temperature=0, bad_words=["x"]), pending_src=1, ban_after=[(7, 11)])]
    expect = logits.clone()
    expect[0] = float("-inf")
    expect[0, [3, 17, 250]] = logits[0, [3, 17, 250]] + torch.tensor([0, -50, 0])
    expect[2, [5, 9]] = float("-inf")  # 42 is not 11: row 3's ban does not apply
    got = adjust_logits(logits, rows, prev)
    assert torch.equal(got, expect)
    assert [s.token_id for s in Sampler()(logits, rows, prev)] == [int(e.argmax()) for e in expect]


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm, tokenizer):
    ids = tokenizer(FRANCE).input_ids
    k = 3
    sp = SamplingParams(temperature=0, max_tokens=8, truncate_prompt_tokens=k)
    cut, ref = llm.generate([FRANCE, {"prompt_token_ids": ids[-k:]}], [sp, SamplingParams(temperature=0, max_tokens=8)],
                            use_tqdm=False)
    assert cut.prompt_token_ids == ids[-k:] and cut.prompt == tokenizer.decode(ids[-k:])
    assert cut.outputs[0].token_ids == ref.outputs[0].token_ids
    assert cut.outputs[0].token_ids != llm.generate([FRANCE], SamplingParams(temperature=0, max_tokens=8),
                                                    use_tqdm=False)[0].outputs[0].token_ids
    whole = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=2,
                                                                     truncate_prompt_tokens=len(ids)), use_tqdm=False)
    assert whole[0].prompt_token_ids == ids
    assert truncate_prompt(list(range(10)), ((0, 3), (4, 7), (7, 10)), 6) == (list(range(4, 10)), ((0, 3), (3, 6)))


def stop_reference(text_of, n: int, stops: list[str], min_tokens: int) -> tuple[int, str] | None:
    """The first token count whose text holds a stop string ending past the first ``min_tokens``
    tokens' text (vLLM's rule), and the text before it."""
    protected = len(text_of(min(min_tokens, n)))
    for m in range(min_tokens + 1, n + 1):
        text = text_of(m)
        ends = [(text.find(s, max(0, protected - len(s) + 1)), s) for s in stops]
        hits = [(i, s) for i, s in ends if i >= 0]
        if hits:
            return m, text[: min(hits)[0]]
    return None


def test_min_tokens_holds_back_stop_strings(llm, tokenizer):
    """A stop string inside the first ``min_tokens`` tokens' text does not end the sequence; one
    that ends after it does (even one that starts inside it); the streamed text only grows."""
    base = llm.generate([FRANCE], SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0].outputs[0]
    ids, stops = base.token_ids, ["\n", ":", ".\n"]
    assert base.text.count("\n") >= 2 and ":" in base.text, base.text
    first = next(m for m in range(1, len(ids) + 1) if "\n" in tokenizer.decode(ids[:m]))
    seen = set()
    for min_tokens in (0, 1, first - 1, first, first + 1):
        m, text = stop_reference(lambda j: tokenizer.decode(ids[:j]), len(ids), stops, min_tokens)
        sp = SamplingParams(temperature=0, max_tokens=20, min_tokens=min_tokens, stop=stops)
        out = llm.generate([FRANCE], sp, use_tqdm=False)[0].outputs[0]
        assert (len(out.token_ids), out.text, out.finish_reason) == (m, text, "stop"), min_tokens
        d, texts = IncrementalDetokenizer(tokenizer, sp), []
        for j in range(1, m + 1):
            d.update(ids[:j])
            texts.append(d.text)
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:])) and texts[-1] == text
        seen.add(m)
    assert len(seen) >= 3  # the rule moved the stop at least twice


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu(tmp_path):
    """On a GPU (async scheduling, so a ban that waits on the token in flight is decided on the
    device; the sampling kernels): fp32 greedy with bad words or allowed ids equals transformers'
    on the same random Llama, seeded samples stay in the allowed set, and the batched adjustment
    equals the CPU's."""
    from kvos import LLM
    from tests.worker.test_gpu import VOCAB, make_model_folder

    hf = make_model_folder(tmp_path).to("cuda")
    llm = LLM(model=str(tmp_path), device="cuda", dtype="float32", num_blocks=256, block_size=16)
    assert llm.engine.async_scheduling
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (5, 40)]

    def ours(**kw):
        sp = SamplingParams(temperature=0, max_tokens=N, min_tokens=N, **kw)
        return sp, [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp,
                                                                 use_tqdm=False)]

    @torch.inference_mode()
    def theirs(p, **kw):
        out = hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=N, min_new_tokens=N, do_sample=False,
                          pad_token_id=0, **kw)
        return out[0, len(p):].tolist()

    _, plain = ours()
    a, tok = plain[0], llm.get_tokenizer()
    word = [t for t in range(1, N) if tok.encode(f"t{a[t]}", add_special_tokens=False) == [a[t]]]  # not "t2..."
    i = next(i for i in word if i + 1 in word)
    for words, ids in (([f"t{a[i]} t{a[i + 1]}"], [[a[i], a[i + 1]]]), ([f"t{a[word[-1]]}"], [[a[word[-1]]]])):
        sp, banned = ours(bad_words=words)
        assert sp.bad_words_token_ids == ids
        for p, got in zip(prompts, banned):
            assert got == theirs(p, bad_words_ids=ids), words
        assert banned[0] != plain[0], words
    allowed = sorted(set(a[1:6]) | {7, 99})
    _, kept = ours(allowed_token_ids=allowed)
    for p, got in zip(prompts, kept):
        assert got == theirs(p, prefix_allowed_tokens_fn=lambda b, ids: allowed) and set(got) <= set(allowed)
    for top_k in (-1, 50):  # the full-vocabulary kernel and the ranked one
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=1.0, top_k=top_k, top_p=0.9, seed=5, n=2, max_tokens=N,
                                           allowed_token_ids=allowed), use_tqdm=False)
        assert all(set(c.token_ids) <= set(allowed) for o in outs for c in o.outputs)
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(1)) * 3
    rows = [SampleRow(0, SamplingParams(temperature=0, allowed_token_ids=[3, 17, 250], logit_bias={17: -50})),
            SampleRow(1, SamplingParams(temperature=0)),
            SampleRow(2, SamplingParams(temperature=0, bad_words=["x"]), pending_src=0, ban_after=[(5, 11), (6, 12)],
                      ban_ids=[9]),
            SampleRow(3, SamplingParams(temperature=0, bad_words=["x"]), pending_src=1, ban_after=[(7, 42)])]
    prev = torch.tensor([11, 42])
    assert torch.equal(adjust_logits(logits.cuda(), rows, prev.cuda()).cpu(), adjust_logits(logits, rows, prev))
