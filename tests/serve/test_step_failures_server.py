"""Over HTTP, a step that raises fails the requests it held with a 500 (a stream: an error event
naming ``engine_error``), counts in ``/metrics``, and the server goes on serving.

The server runs in this process on the shared engine (``uvicorn`` on a thread, the official
``openai`` client over a real socket), so a fault can be injected into the engine's steps: its
``schedule_hook`` raises for a step holding a prompt that starts with the poison text."""
from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest
import uvicorn

from kvos.engine.async_engine import AsyncEngine
from kvos.serve.app import create_app
from tests.support.hf_reference import hf_greedy
from tests.support.server import free_port

POISON = "Poison pill:"


@pytest.fixture(scope="module")
def served(llm, tokenizer):
    engine = llm.engine
    poison = tokenizer(POISON).input_ids

    def hook(out) -> None:
        if any(s.request.prompt_token_ids[:len(poison)] == poison for s in out.seqs):
            raise RuntimeError("injected fault")

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(AsyncEngine(engine), "default", warmup=False),
                                           host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    engine.schedule_hook = hook
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.1)
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(30)
        engine.schedule_hook = None


def metric(url: str, line_start: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return float(next(line for line in text.splitlines() if line.startswith(line_start)).split()[-1])


def test_a_failing_step_is_a_500_and_the_server_goes_on(served, hf_model, tokenizer):
    client = openai.OpenAI(base_url=f"{served}/v1", api_key="unused", max_retries=0)
    failed_before = metric(served, "kvos:engine_failed_steps_total")
    with pytest.raises(openai.InternalServerError) as e:
        client.completions.create(model="default", prompt=f"{POISON} one", max_tokens=4)
    assert e.value.body["code"] == "engine_error"
    assert "injected fault" in e.value.body["message"]

    stream = client.completions.create(model="default", prompt=f"{POISON} two", max_tokens=4, stream=True)
    with pytest.raises(openai.APIError, match="injected fault"):
        for _ in stream:
            pass

    assert metric(served, "kvos:engine_failed_steps_total") == failed_before + 2
    assert metric(served, 'kvos:request_success_total{finished_reason="error"}') >= 2

    ids = tokenizer("One, two, three,").input_ids  # the same engine answers the next request correctly
    reply = client.completions.create(model="default", prompt="One, two, three,", max_tokens=6, temperature=0)
    assert reply.choices[0].finish_reason == "length"
    assert reply.choices[0].text == tokenizer.decode(hf_greedy(hf_model, ids, 6)[0])
