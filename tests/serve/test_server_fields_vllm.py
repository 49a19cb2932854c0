"""vLLM's extra body fields ``allowed_token_ids``, ``bad_words`` and ``truncate_prompt_tokens``,
and ``min_tokens`` with ``stop``, through a real ``kvos serve`` (the shared one,
``--max-model-len 512``): accepted, honoured as in process, and a bad value is a 400 naming it."""
from __future__ import annotations

import httpx
import pytest

from kvos import SamplingParams

FRANCE = "The capital of France is"
CHAT = [{"role": "user", "content": "Write a poem about the sea."}]


def post(server, path: str, **body) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/{path}", json={"temperature": 0, "max_tokens": 8, **body}, timeout=60)


def in_process(llm, prompt, **kw):
    return llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, **kw), use_tqdm=False)[0]


def test_allowed_token_ids_and_bad_words(server, llm, tokenizer):
    allowed = [tokenizer.encode(w)[0] for w in [" the", " city", " of", " Paris", "."]]
    r = post(server, "completions", prompt=FRANCE, allowed_token_ids=allowed, return_token_ids=True)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert set(choice["token_ids"]) <= set(allowed)
    assert choice["token_ids"] == in_process(llm, FRANCE, allowed_token_ids=allowed).outputs[0].token_ids
    plain = post(server, "completions", prompt=FRANCE).json()["choices"][0]["text"]
    assert "Paris" in plain
    r = post(server, "completions", prompt=FRANCE, bad_words=["Paris"])
    assert r.status_code == 200, r.text
    assert "Paris" not in r.json()["choices"][0]["text"]
    assert r.json()["choices"][0]["text"] == in_process(llm, FRANCE, bad_words=["Paris"]).outputs[0].text
    chat = post(server, "chat/completions", messages=CHAT, max_tokens=12).json()["choices"][0]["message"]["content"]
    assert "ocean" in chat, chat
    r = post(server, "chat/completions", messages=CHAT, max_tokens=12, bad_words=["ocean"])
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["message"]["content"]
    assert "ocean" not in text and text != chat


def test_truncate_prompt_tokens(server, llm, tokenizer):
    ids = tokenizer(FRANCE).input_ids
    r = post(server, "completions", prompt=FRANCE, truncate_prompt_tokens=3, echo=True)
    assert r.status_code == 200, r.text
    body = r.json()
    ref = in_process(llm, {"prompt_token_ids": ids[-3:]})
    assert body["usage"]["prompt_tokens"] == 3
    assert body["choices"][0]["text"] == tokenizer.decode(ids[-3:]) + ref.outputs[0].text  # echo: what was kept
    long = "The kernel maps virtual pages to physical frames. " * 100  # past --max-model-len 512
    assert post(server, "completions", prompt=long).status_code == 400
    r = post(server, "completions", prompt=long, truncate_prompt_tokens=100, max_tokens=2)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 100, r.text
    r = post(server, "chat/completions", messages=[{"role": "user", "content": long}], truncate_prompt_tokens=50,
             max_tokens=2)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 50, r.text


def test_min_tokens_holds_back_stop(server):
    stopped = post(server, "completions", prompt=FRANCE, stop=["\n"], max_tokens=20).json()["choices"][0]
    assert stopped["finish_reason"] == "stop" and stopped["text"] == " Paris."
    r = post(server, "completions", prompt=FRANCE, stop=["\n"], max_tokens=20, min_tokens=3).json()["choices"][0]
    assert r["finish_reason"] == "stop" and r["text"] == " Paris.\n"  # the first "\n" was the 3rd token


@pytest.mark.parametrize("field, value", [
    ("allowed_token_ids", []), ("allowed_token_ids", [-1]), ("allowed_token_ids", [10**7]),
    ("bad_words", "Paris"), ("bad_words", ["  "]), ("truncate_prompt_tokens", 0), ("truncate_prompt_tokens", "3"),
])
def test_bad_values_name_the_field(server, field, value):
    for path, body in (("completions", {"prompt": FRANCE}), ("chat/completions", {"messages": CHAT})):
        r = post(server, path, **body, **{field: value})
        assert r.status_code == 400, (path, field, value, r.text)
        assert r.json()["error"]["param"].split(".")[0] == field, r.json()


def test_chat_prompt_logprobs_match_transformers(server, tokenizer, hf_model):
    """vLLM's ``prompt_logprobs`` on a chat: the rendered prompt's tokens, each with its logprob
    and rank against transformers' log-softmax on the same ids; refused with ``stream``."""
    import torch

    r = post(server, "chat/completions", messages=CHAT, max_tokens=1, prompt_logprobs=2)
    assert r.status_code == 200, r.text
    plps = r.json()["prompt_logprobs"]
    ids = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids)
    assert len(plps) == len(ids) and plps[0] is None
    with torch.inference_mode():
        ref = torch.log_softmax(hf_model(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)
    for pos in range(1, len(ids)):
        entry, row = plps[pos], ref[pos - 1]
        mine = entry[str(ids[pos])]
        assert abs(mine["logprob"] - row[ids[pos]].item()) <= 1e-3
        lo = 1 + int((row > row[ids[pos]] + 1e-3).sum())
        assert lo <= mine["rank"] <= int((row >= row[ids[pos]] - 1e-3).sum())
        assert mine["decoded_token"] == tokenizer.decode([ids[pos]])
    r = post(server, "chat/completions", messages=CHAT, prompt_logprobs=2, stream=True)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
