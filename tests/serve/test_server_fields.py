"""Issue #16: the fields OpenAI and vLLM clients send are accepted and take effect (checked
through the real openai client against a real ``kvos serve``)."""
from __future__ import annotations

import httpx
import openai
import pytest


MODEL = "SmolLM2-135M-Instruct"
REPEAT = "Repeat after me: cat cat cat cat cat cat cat cat"
CHAT = [{"role": "user", "content": "Reply with just the word yes."}]


def complete(client, prompt=REPEAT, **kw):
    kw = {"max_tokens": 8, "temperature": 0, **kw}
    extra = {k: kw.pop(k) for k in ("repetition_penalty", "min_tokens", "stop_token_ids", "prompt_logprobs")
             if k in kw}
    return client.completions.create(model=MODEL, prompt=prompt, extra_body=extra or None, **kw)


def token_ids(server, text: str) -> list[int]:
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": text, "add_special_tokens": False})
    return r.json()["tokens"]


@pytest.fixture(scope="module")
def base(client):
    r = complete(client)
    words = r.choices[0].text.split()
    assert len(words) >= 4 and len(set(words)) == 1, r.choices[0].text  # greedy repeats one token
    return r


def test_penalties_break_the_repetition(client, base):
    for kw in (dict(presence_penalty=2.0), dict(frequency_penalty=2.0), dict(repetition_penalty=1.5)):
        r = complete(client, **kw)
        assert r.choices[0].text != base.choices[0].text, kw
        assert len(set(r.choices[0].text.split())) > 1, kw
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": REPEAT}],
                                          max_tokens=4, temperature=0, presence_penalty=0.5,
                                          frequency_penalty=0.5, extra_body={"repetition_penalty": 1.1})
    assert chat.choices[0].message.content


def test_logit_bias_and_stop_token_ids(server, client, base):
    ids = token_ids(server, base.choices[0].text)
    banned = complete(client, logit_bias={str(ids[0]): -100})
    assert banned.choices[0].text != base.choices[0].text
    assert token_ids(server, banned.choices[0].text)[0] != ids[0]
    forced = complete(client, prompt="The capital of France is", logit_bias={ids[0]: 100}, max_tokens=3)
    assert forced.choices[0].text == base.choices[0].text[: len(forced.choices[0].text)]
    assert base.choices[0].finish_reason == "length"
    stop = ids[1]
    r = complete(client, stop_token_ids=[stop])
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == ids.index(stop) + 1
    assert r.choices[0].stop_reason == stop and base.choices[0].stop_reason is None  # vLLM's field
    word = base.choices[0].text.split()[1]
    s = complete(client, stop=[word])
    assert s.choices[0].finish_reason == "stop" and s.choices[0].stop_reason == word
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0,
                                          extra_body={"stop_token_ids": [ids[0]], "min_tokens": 0})
    assert chat.choices[0].stop_reason in (None, ids[0])
    streamed = [c for c in client.completions.create(model=MODEL, prompt=REPEAT, max_tokens=8, temperature=0,
                                                     stop=[word], stream=True)]
    assert streamed[-1].choices[0].finish_reason == "stop" and streamed[-1].choices[0].stop_reason == word
    assert all(c.choices[0].stop_reason is None for c in streamed[:-1])
    far = complete(client, min_tokens=2, stop_token_ids=[10**7], max_tokens=3)  # an id past the vocabulary
    assert far.choices[0].text == base.choices[0].text[: len(far.choices[0].text)]
    err = pytest.raises(openai.BadRequestError, complete, client, logit_bias={str(10**7): 5})
    assert err.value.body["param"] == "logit_bias"


def test_min_tokens_delays_eos(client):
    short = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=40, temperature=0)
    assert short.choices[0].finish_reason == "stop"
    n = short.usage.completion_tokens
    longer = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=n + 8, temperature=0,
                                            extra_body={"min_tokens": n + 4})
    assert longer.usage.completion_tokens >= n + 4


def test_echo_and_prompt_logprobs(client):
    prompt = "The capital of France is"
    plain = complete(client, prompt=prompt, max_tokens=5)
    echoed = complete(client, prompt=prompt, max_tokens=5, echo=True)
    assert echoed.choices[0].text == prompt + plain.choices[0].text
    streamed = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0,
                                              echo=True, stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == echoed.choices[0].text
    r = complete(client, prompt=prompt, max_tokens=2, prompt_logprobs=2)
    plp = r.choices[0].model_extra["prompt_logprobs"]
    assert len(plp) == r.usage.prompt_tokens and plp[0] is None
    for entry in plp[1:]:
        assert 1 <= len(entry) <= 3
        assert all(v["logprob"] <= 0 and v["rank"] >= 1 and isinstance(v["decoded_token"], str)
                   for v in entry.values())
    assert r.choices[0].text == plain.choices[0].text[: len(r.choices[0].text)]
    chunks = [c for c in client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0,
                                                   stream=True, extra_body={"prompt_logprobs": 1}) if c.choices]
    sent = [c.choices[0].model_extra.get("prompt_logprobs") for c in chunks]
    assert len(sent[0]) == r.usage.prompt_tokens and all(x is None for x in sent[1:])


def test_echo_with_logprobs_gives_the_prompt_tokens_first(client):
    """OpenAI's and vLLM's legacy shape: with ``echo`` and ``logprobs`` the logprobs cover the
    prompt's tokens (the first one's null) and then the completion's; the prompt part agrees with
    ``prompt_logprobs`` and the completion part with the same request without ``echo``."""
    prompt = "The capital of France is"
    plain = complete(client, prompt=prompt, max_tokens=3, logprobs=2)
    ref = complete(client, prompt=prompt, max_tokens=1, prompt_logprobs=2).choices[0].model_extra["prompt_logprobs"]
    r = complete(client, prompt=prompt, max_tokens=3, logprobs=2, echo=True)
    lp, n = r.choices[0].logprobs, r.usage.prompt_tokens
    assert "prompt_logprobs" not in (r.choices[0].model_extra or {})
    assert len(lp.tokens) == n + r.usage.completion_tokens and lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None and lp.text_offset[0] == 0
    for j in range(1, n):  # each prompt_logprobs entry lists the prompt's own token first
        own = next(iter(ref[j].values()))
        assert own["decoded_token"] == lp.tokens[j] and abs(lp.token_logprobs[j] - own["logprob"]) < 1e-4
    assert lp.tokens[n:] == plain.choices[0].logprobs.tokens
    assert lp.token_logprobs[n:] == pytest.approx(plain.choices[0].logprobs.token_logprobs, abs=1e-4)
    assert lp.text_offset[n] == len(prompt) and lp.text_offset == sorted(lp.text_offset)
    chunks = [c for c in client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0,
                                                   logprobs=2, echo=True, stream=True) if c.choices]
    first = chunks[0].choices[0].logprobs
    assert first.token_logprobs[0] is None and first.tokens[:n] == lp.tokens[:n]


def test_response_format_names_and_tools(client):
    ok = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi", "name": "ann"},
                                                               *CHAT], max_tokens=3, temperature=0,
                                        response_format={"type": "text"})
    assert ok.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as e:  # the legacy function calling (tools are served)
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, functions=[{"name": "f"}])
    assert e.value.body["param"] == "functions" and "not supported" in e.value.body["message"]


def test_return_token_ids(server, client, base):
    """vLLM's ``return_token_ids``: the choice's ids decode to its text; the prompt's ids are the
    tokenizer's."""
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": REPEAT, "max_tokens": 8, "temperature": 0,
                                                         "return_token_ids": True}, timeout=60).json()
    choice = r["choices"][0]
    assert choice["text"] == base.choices[0].text
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": choice["token_ids"]}).json()["prompt"] == choice["text"]
    assert choice["prompt_token_ids"] == httpx.post(f"{server.url}/tokenize", json={"prompt": REPEAT}).json()["tokens"]
    chat = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": CHAT, "max_tokens": 4, "temperature": 0,
                                                                 "return_token_ids": True}, timeout=60).json()
    assert len(chat["choices"][0]["token_ids"]) == chat["usage"]["completion_tokens"]
    assert "token_ids" not in (complete(client).choices[0].model_extra or {})  # off by default


def test_unset_sampling_fields_take_the_model_s_recommended_values(client, llm):
    """The default model recommends temperature 0.2 and top_p 0.9 (its release's values): a
    seeded request that sets neither samples exactly as those values do in process; a field the
    request sets wins."""
    from kvos import SamplingParams

    prompt = "Name three colors."
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, seed=11)
    ref = llm.generate([prompt], SamplingParams(temperature=0.2, top_p=0.9, seed=11, max_tokens=16),
                       use_tqdm=False)[0].outputs[0]
    assert r.choices[0].text == ref.text
    hot = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, seed=11, temperature=1.0, top_p=1.0)
    ref_hot = llm.generate([prompt], SamplingParams(temperature=1.0, seed=11, max_tokens=16), use_tqdm=False)[0]
    assert hot.choices[0].text == ref_hot.outputs[0].text
