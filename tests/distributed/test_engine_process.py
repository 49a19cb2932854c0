"""``kvos serve --transport process``: the engine loop in a process of its own (no Ray), driven
by a real HTTP client; faults are real signals (SIGKILL, SIGSTOP). Later tests build on earlier
ones: the kill uses the engine's one restart; the admin test adds a second engine, which the
hang test stops and resumes and the last test removes before the first engine fails for good."""
from __future__ import annotations

import json
import os
import signal
import threading

import httpx
import openai
import pytest

from kvos import SamplingParams
from tests.support.server import Server, engines, wait_until

MODEL = "SmolLM2-135M-Instruct"
ADMIN_KEY = "test-admin-key"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


@pytest.fixture(scope="module")
def server():
    s = Server("--transport", "process", "--max-model-len", "1024", "--num-blocks", "256", "--engine-timeout-s", "10",
               "--engine-max-restarts", "1", "--admin-key", ADMIN_KEY).wait_ready(timeout=600)
    yield s
    assert s.stop() == 0
    assert "did not stop" not in s.output()  # the engine processes shut down when asked, not killed


def test_outputs_equal_the_in_process_engine(server, llm):
    state = engines(server)
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok", "engines_up": 1}
    assert state[0]["pid"] not in (server.proc.pid, os.getpid())  # the engine runs elsewhere
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    refs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    got = client.completions.create(model=MODEL, prompt=prompts, max_tokens=16, temperature=0)
    assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == [r.outputs[0].text for r in refs]
    text = "".join(chunk.choices[0].text for chunk in client.completions.create(
        model=MODEL, prompt=prompts[1], max_tokens=16, temperature=0, stream=True))
    assert text == refs[1].outputs[0].text
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
                                          temperature=0, seed=3)
    assert chat.choices[0].message.content and chat.usage.completion_tokens == 8
    ids = llm.get_tokenizer().encode("Hello world")
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": ids}).json() == {"prompt": "Hello world"}


def test_pins_go_through_to_the_engine_process(server):
    """A pinned prefix is computed and held in the engine process: it is listed with its blocks,
    a request sharing it hits all of them, and it can be deleted once."""
    url = f"{server.url}/v1/cache/pins"
    system = "You are the support bot of ACME. Answer in two sentences. " * 4
    pin = httpx.post(url, json={"prompt": system, "ttl_s": 600}, timeout=120)
    assert pin.status_code == 200, pin.text
    body = pin.json()
    assert body["pinned_blocks"] >= 2 and body["pinned_tokens"] == 16 * body["pinned_blocks"]
    assert 0 < body["expires_in_s"] <= 600
    listed = httpx.get(url).json()["data"]
    assert [(p["id"], p["pinned_blocks"]) for p in listed] == [(body["id"], body["pinned_blocks"])]
    r = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": system + "Hello?",
                                                          "max_tokens": 2}, timeout=120).json()
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] >= body["pinned_tokens"]
    assert httpx.delete(f"{url}/{body['id']}").status_code == 200
    assert httpx.delete(f"{url}/{body['id']}").status_code == 404 and httpx.get(url).json()["data"] == []


def test_kv_summary_reads_the_engine_process(server):
    """``GET /v1/kv/summary`` through the process transport: the engine's own pages and its
    most-hit prefixes (``EngineWorker.top_prefixes``), each row naming its engine."""
    import random

    rng = random.Random(43)
    shared = [rng.randrange(1000, 40000) for _ in range(4 * 16)]  # 4 blocks of 16 tokens
    for tail in ([5, 6, 7], [8, 9, 10]):
        r = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": shared + tail, "max_tokens": 1},
                       timeout=120)
        assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
    s = httpx.get(f"{server.url}/v1/kv/summary", params={"top": 100}, timeout=60).json()
    [engine] = s["engines"]
    assert engine["up"] and engine["pid"] == engines(server)[0]["pid"] != server.proc.pid
    assert s["pages"]["total"] == 255 == s["pages"]["free"] + sum(g["pages"] for g in s["groups"])
    assert s["hit_rate"]["hits_tokens"] >= 64
    assert any((p["hits"], p["tokens"], p["engine"]) == (1, 64, 0) for p in s["top_prefixes"]), s["top_prefixes"]


def test_a_killed_engine_process_ends_its_stream_and_comes_back(server, llm):
    """SIGKILL the engine process mid-stream: the stream ends with an engine_unavailable error
    event and [DONE] (never a hang), the server stays up, the engine process is started anew and
    serves the same outputs."""
    events: list[str] = []
    started = threading.Event()

    def stream() -> None:
        body = {"model": MODEL, "prompt": "Count from one to one thousand:", "max_tokens": 400, "temperature": 0,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=300) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    started.set()

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(120)
    victim = engines(server)[0]["pid"]
    queries = server.metric("kvos:prefix_cache_queries_total")
    assert queries > 0
    os.kill(victim, signal.SIGKILL)
    t.join(300)
    assert not t.is_alive() and events[-1] == "[DONE]"
    assert any(json.loads(e).get("error", {}).get("code") == "engine_unavailable" for e in events[:-1]), events[-3:]
    wait_until(lambda: engines(server)[0].get("up") == 1.0 and engines(server)[0].get("pid") not in (None, victim),
               timeout=300)
    ref = llm.generate(["The speed of light is"], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    r = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "The speed of light is",
                                                          "max_tokens": 12, "temperature": 0}, timeout=300)
    assert r.json()["choices"][0]["text"] == ref.outputs[0].text
    assert server.metric("kvos:prefix_cache_queries_total") >= queries  # counters survive the restart


def complete(server, prompt: str, max_tokens: int = 4) -> dict:
    r = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                                                          "temperature": 0}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def test_admin_adds_drains_and_resumes_engines(server):
    url = f"{server.url}/admin/engines"
    assert httpx.get(url).status_code == 401
    assert httpx.get(url, headers={"Authorization": "Bearer wrong"}).status_code == 401
    added = httpx.post(url, headers=ADMIN, timeout=300)
    assert added.status_code == 200, added.text
    assert added.json()["added"] == 1
    wait_until(lambda: engines(server).get(1, {}).get("up") == 1.0, timeout=60)
    healthy = {"status": "ok", "engines_up": 2}
    wait_until(lambda: httpx.get(f"{server.url}/health").json() == healthy, timeout=60)
    drained = httpx.post(f"{url}/0/drain", headers=ADMIN).json()["engines"]
    assert {e["engine"]: e["state"] for e in drained} == {0: "draining", 1: "up"}
    assert httpx.get(f"{server.url}/health").json()["engines_down"] == {"0": "draining"}
    before = server.metric("kvos:router_requests_total", 'engine="1",policy="kv_aware"')
    for i in range(3):
        complete(server, f"Tell me about the number {i}.")
    assert server.metric("kvos:router_requests_total", 'engine="1",policy="kv_aware"') == before + 3  # all on the other engine
    r = httpx.post(f"{url}/7/drain", headers=ADMIN)
    assert r.status_code == 400 and "no engine 7" in r.json()["error"]["message"]
    httpx.post(f"{url}/0/resume", headers=ADMIN).raise_for_status()
    wait_until(lambda: httpx.get(f"{server.url}/health").json() == healthy, timeout=60)


def test_a_stopped_engine_is_routed_around_and_returns(server, llm):
    """SIGSTOP engine 1: within its 10 s deadline it is marked unresponsive (/health degraded,
    naming it), requests complete on engine 0; after SIGCONT it answers and takes requests again."""
    pid = engines(server)[1]["pid"]
    prompts = [f"Write a sentence about the colour number {i}." for i in range(4)]
    refs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    os.kill(pid, signal.SIGSTOP)
    try:
        results: dict[int, str] = {}

        def send(i: int) -> None:
            results[i] = complete(server, prompts[i], 8)["choices"][0]["text"]

        threads = [threading.Thread(target=send, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        wait_until(lambda: httpx.get(f"{server.url}/health").json().get("engines_down") == {"1": "unresponsive"},
                   timeout=60)
        health = httpx.get(f"{server.url}/health")
        assert health.status_code == 200 and health.json()["status"] == "degraded"
        for t in threads:
            t.join(120)
            assert not t.is_alive()
        assert results == {i: r.outputs[0].text for i, r in enumerate(refs)}
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_until(lambda: httpx.get(f"{server.url}/health").json() == {"status": "ok", "engines_up": 2}, timeout=60)
    assert engines(server)[1]["pid"] == pid  # the same process, back


def test_removing_an_engine_and_running_out_of_restarts(server):
    """DELETE /admin/engines/1 stops it for good; then engine 0, out of restarts, is killed: the
    server reports it failed (503 naming it) and its process is reaped."""
    removed = httpx.delete(f"{server.url}/admin/engines/1", headers=ADMIN, timeout=120)
    assert removed.status_code == 200, removed.text
    assert [e["engine"] for e in removed.json()["engines"]] == [0]
    r = httpx.delete(f"{server.url}/admin/engines/0", headers=ADMIN)
    assert r.status_code == 400 and "last decode engine" in r.json()["error"]["message"]
    pid = engines(server)[0]["pid"]
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: httpx.get(f"{server.url}/health").json().get("engines_down") == {"0": "failed"}, timeout=60)
    assert httpx.get(f"{server.url}/health").status_code == 503
    wait_until(lambda: not os.path.exists(f"/proc/{pid}"), timeout=30)  # reaped, not a zombie
