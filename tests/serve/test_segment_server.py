"""Segment reuse through a real ``kvos serve --segment-reuse`` and the official openai client:
a completions prompt given as parts, chat messages as segments, the metrics, and bad parts."""
from __future__ import annotations

import httpx
import openai
import pytest

from tests.support.server import Server

MODEL = "SmolLM2-135M-Instruct"
DOC = open("kvos/bench/data/macbeth_act1_scenes1-4.txt").read()[:1200]


@pytest.fixture(scope="module")
def server():
    s = Server("--max-model-len", "1024", "--segment-reuse", "--segment-recompute", "0.1").wait_ready()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_completion_parts_reuse_a_document_at_another_position(client, server):
    first = client.completions.create(model=MODEL, max_tokens=4, temperature=0,
                                      prompt=[{"text": "Passage one.\n"}, {"text": DOC}, {"text": "\nWho speaks?"}])
    assert first.usage.prompt_tokens_details.cached_tokens == 0  # the document is new: computed (and alone)
    second = client.completions.create(model=MODEL, max_tokens=4, temperature=0,
                                       prompt=[{"text": "Another preface, longer than before.\n"}, {"text": DOC},
                                               {"text": "\nWho speaks?"}])
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 200 < cached < second.usage.prompt_tokens
    assert server.metric("kvos:segment_hits_total") >= 1
    assert server.metric("kvos:segment_reused_tokens_total") >= cached
    assert server.metric("kvos:segment_recomputed_tokens_total") > 0


def test_chat_messages_are_segments(client):
    doc = {"role": "user", "content": "Here is a passage:\n" + DOC}
    q = {"role": "user", "content": "Who speaks first?"}
    client.chat.completions.create(model=MODEL, max_tokens=2, temperature=0,
                                   messages=[{"role": "system", "content": "Be brief."}, doc, q])
    later = client.chat.completions.create(model=MODEL, max_tokens=2, temperature=0,
                                           messages=[{"role": "system", "content": "Answer in one word only."},
                                                     doc, q])
    assert later.usage.prompt_tokens_details.cached_tokens > 200


def test_bad_part_is_a_400_naming_prompt(server):
    r = httpx.post(f"{server.url}/v1/completions", json={
        "model": MODEL, "prompt": [{"text": "a", "token_ids": [1]}]}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = httpx.post(f"{server.url}/v1/completions", json={
        "model": MODEL, "prompt": [{"text": "a"}, {"token_ids": [10 ** 9]}]}, timeout=30)
    assert r.status_code == 400 and "segments[1]" in r.json()["error"]["message"]
    for bad in ({"foo": 1}, {"text": 5}, {"token_ids": []}):  # the bad part is named, not the good one before it
        r = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": [{"text": "a"}, bad]},
                       timeout=30)
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == "prompt", error
        assert error["message"].startswith("prompt: segments[1] must be"), error
