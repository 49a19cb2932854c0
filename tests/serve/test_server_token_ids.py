"""Serving without a tokenizer (``--skip-tokenizer-init``, vLLM's flag): token ids in, token ids out,
through a real ``kvos serve`` and a real HTTP client; the ids are the transformers-verified
engine's (the session ``llm``), and whatever needs text is refused naming its field."""
from __future__ import annotations

import json

import httpx
import pytest

from kvos import SamplingParams
from tests.support.server import Server

PROMPTS = [[1, 504, 3458, 282, 4649, 314], [1, 23, 345, 6789, 1011, 12, 13, 14, 15, 16, 17]]


@pytest.fixture(scope="module")
def server():
    s = Server("--skip-tokenizer-init", "--max-model-len", "512", "--num-blocks", "64").wait_ready()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def reference(llm):
    """The greedy ids of the engine with its tokenizer (token-identical to transformers elsewhere)."""
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def complete(server, **body) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", json={"max_tokens": 12, "temperature": 0,
                                                            "ignore_eos": True, **body}, timeout=60)


def test_token_ids_in_and_out(server, reference):
    r = complete(server, prompt=PROMPTS)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["token_ids"] for c in choices] == reference
    assert [c["prompt_token_ids"] for c in choices] == PROMPTS
    assert all(c["text"] == "" for c in choices)
    assert r.json()["usage"]["completion_tokens"] == 24


def test_stream_carries_every_token_once(server, reference):
    ids, prompt_ids, chunks = [], None, 0
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60,
                      json={"prompt": PROMPTS[1], "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                            "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            chunks += 1
            ids += choice["token_ids"]
            prompt_ids = prompt_ids or choice.get("prompt_token_ids")
    assert ids == reference[1]
    assert prompt_ids == PROMPTS[1]
    assert chunks >= 2  # streamed as the tokens came, not in one piece


def test_logprobs_name_tokens_by_id(server, reference):
    r = complete(server, prompt=PROMPTS[0], max_tokens=3, logprobs=2)
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["tokens"] == [f"token_id:{t}" for t in reference[0][:3]]
    assert all(len(top) >= 1 for top in lp["top_logprobs"])


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "Hello"}, "prompt"),
    ("/v1/completions", {"prompt": PROMPTS[0], "echo": True}, "echo"),
    ("/v1/completions", {"prompt": PROMPTS[0], "stop": ["x"]}, "stop"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}, "messages"),
    ("/tokenize", {"prompt": "Hello"}, "prompt"),
    ("/detokenize", {"tokens": [1, 2]}, "tokens"),
])
def test_what_needs_text_is_refused_naming_the_field(server, path, body, param):
    r = httpx.post(f"{server.url}{path}", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert "tokenizer" in r.json()["error"]["message"]


def test_still_serves_after_refusals(server, reference):
    assert complete(server, prompt=PROMPTS[0]).json()["choices"][0]["token_ids"] == reference[0]
