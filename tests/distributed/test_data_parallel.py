"""``kvos serve --data-parallel 2``: two engine actors of the default model on a two-node Ray
cluster (two ``ray start`` on this machine), one per node, behind one endpoint and the kv_aware
router, driven by a real HTTP client; faults are real process kills."""
from __future__ import annotations

import os
import signal
import threading

import httpx
import openai
import pytest

from kvos import SamplingParams
from tests.support.ray_nodes import two_node_cluster
from tests.support.server import Server, engines, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.ray]

pytest.importorskip("ray")

MODEL = "SmolLM2-135M-Instruct"


ADMIN = {"Authorization": "Bearer test-admin-key"}


@pytest.fixture(scope="module")
def server():
    """Two engines joined to a two-node cluster made by `ray start` (token authentication on; the
    server gets the token as a user on another host would, by RAY_AUTH_TOKEN_PATH)."""
    with two_node_cluster() as (address, token):
        s = Server("--data-parallel", "2", "--router", "kv_aware", "--ray-address", address, "--max-model-len", "1024",
                   "--num-blocks", "256", "--admin-key", "test-admin-key",
                   env={"RAY_AUTH_TOKEN_PATH": str(token)}).wait_ready(timeout=600)
        yield s
        assert s.stop() == 0


def test_engines_are_placed_on_different_nodes(server):
    listed = httpx.get(f"{server.url}/admin/engines", headers=ADMIN).json()["engines"]
    assert [e["state"] for e in listed] == ["up", "up"]
    nodes = {e["node"] for e in listed}
    assert len(nodes) == 2 and None not in nodes, listed  # placement spread the engines over the two nodes


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


def test_greedy_outputs_equal_one_engine(server, client, llm):
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok", "engines_up": 2}
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "The speed of light is"]
    refs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    for prompt, ref in zip(prompts, refs):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
        assert r.choices[0].text == ref.outputs[0].text


def test_chats_follow_their_prefix_to_its_engine(server, client):
    """Four conversations with distinct long system prompts, three turns each. Only the engine
    that served a conversation's earlier turn can hold its prefix, so a later turn reporting at
    least the earlier prompt's full blocks as cached was routed to that engine."""
    def routed() -> list[float]:
        return [server.metric("kvos:router_requests_total", f'engine="{e}",policy="kv_aware"') for e in (0, 1)]

    before = routed()
    convs = [[{"role": "system", "content": f"You are assistant number {i}. " + f"Topic {i} matters. " * 40}]
             for i in range(4)]
    previous = [0] * 4  # each conversation's last prompt length
    for turn in range(3):
        for i, msgs in enumerate(convs):
            msgs.append({"role": "user", "content": f"Question {turn} about topic {i}?"})
            r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0)
            msgs.append({"role": "assistant", "content": r.choices[0].message.content})
            cached = r.usage.prompt_tokens_details.cached_tokens
            if turn:
                assert cached >= previous[i] // 16 * 16, (turn, i, cached, previous[i])
            previous[i] = r.usage.prompt_tokens
    after = routed()
    assert all(a - b >= 3 for a, b in zip(after, before)), (before, after)  # both engines serve conversations
    assert server.metric("kvos:router_obtained_hit_blocks_total") >= 8 * 10


def test_a_burst_of_new_prompts_spreads_over_the_engines(server):
    """Eight distinct prompts sent at the same moment: each routing choice counts before the
    engine answers, so the burst is not all sent to the engine that looked least loaded first."""
    def routed() -> list[float]:
        return [server.metric("kvos:router_requests_total", f'engine="{e}",policy="kv_aware"') for e in (0, 1)]

    before = routed()
    barrier = threading.Barrier(8)

    def send(i: int) -> None:
        barrier.wait()
        r = httpx.post(f"{server.url}/v1/completions", timeout=300,
                       json={"model": MODEL, "prompt": f"Burst {i}: " + f"item {i} " * (20 + i), "max_tokens": 2})
        assert r.status_code == 200

    threads = [threading.Thread(target=send, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    got = [a - b for a, b in zip(routed(), before)]
    assert sum(got) == 8 and min(got) >= 2, got


def test_tenants_keep_their_salts_across_engines(server):
    """A prefix cached for one tenant is a hit for that tenant, on whatever engine the router
    picks, and never for another tenant."""
    prompt = "Tenant isolation matters. " * 30 + "Say hi."

    def cached(salt: str) -> int:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0, "cache_salt": salt}
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("tenant-a") == 0
    assert cached("tenant-a") > 0
    assert cached("tenant-b") == 0


def test_a_killed_engine_loses_no_plain_request_and_cuts_streams_cleanly(server, client, llm):
    """Two streams (one per engine) and four plain requests run when the busier engine is killed
    (SIGKILL): the plain ones all finish, equal to one engine's outputs, those it held moved to
    the other engine; its stream ends with an engine_unavailable error event and [DONE], not a
    hang, while the other stream completes; Ray restarts the engine and the router takes it back."""
    prompts = [f"Write a long story about the number {i}." for i in range(4)]
    refs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    retried = server.metric("kvos:router_retried_requests_total")
    started = [threading.Event(), threading.Event()]
    events: list[list[str]] = [[], []]

    def stream(k: int) -> None:
        body = {"model": MODEL, "prompt": f"Count from {k} to one thousand:", "max_tokens": 100, "temperature": 0,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=300) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events[k].append(line[6:])
                    started[k].set()

    results: dict[int, str] = {}

    def plain(i: int) -> None:
        r = client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=40, temperature=0,
                                      extra_body={"ignore_eos": True})
        results[i] = r.choices[0].text

    streams = [threading.Thread(target=stream, args=(k,)) for k in range(2)]
    for t, e in zip(streams, started):  # the second finds the first's engine busy: one stream each
        t.start()
        assert e.wait(120)
    plains = [threading.Thread(target=plain, args=(i,)) for i in range(4)]
    for t in plains:
        t.start()
    state: dict = {}

    def all_running() -> bool:  # the snapshot that met it: a stream may end right after
        state.clear()
        state.update(engines(server))
        return sum(s.get("running", 0) for s in state.values()) >= 5

    wait_until(all_running, timeout=60)
    assert all(s.get("running", 0) >= 1 for s in state.values()), state  # both engines busy
    victim = max(state, key=lambda e: state[e].get("running", 0))
    os.kill(state[victim]["pid"], signal.SIGKILL)
    for t in streams + plains:
        t.join(300)
        assert not t.is_alive()
    assert results == {i: ref.outputs[0].text for i, ref in enumerate(refs)}
    assert server.metric("kvos:router_retried_requests_total") > retried  # some were on the victim
    assert all(e[-1] == "[DONE]" for e in events)
    cut = [any('"engine_unavailable"' in x for x in e) for e in events]
    assert sorted(cut) == [False, True], events  # the victim's stream was cut, the other finished
    assert server.metric("kvos:router_engine_failures_total") >= 1
    wait_until(lambda: engines(server)[victim].get("up") == 1.0
               and engines(server)[victim].get("pid") not in (None, state[victim]["pid"]))
    r = client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=40, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == refs[0].outputs[0].text
