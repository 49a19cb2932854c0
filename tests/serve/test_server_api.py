"""The server as load tools and clients expect it (issue #16): model retrieval, vLLM's /version,
/tokenize and /detokenize, context-length errors, schema details, CORS and client disconnects.
Real ``kvos serve`` processes, real HTTP, the real ``openai`` client."""
from __future__ import annotations

import json
import re
import time

import httpx
import openai
import pytest

from tests.support.server import Server

MODEL = "SmolLM2-135M-Instruct"
MAX_LEN = 512
ORIGINS = "https://a.example,https://b.example"
CHAT = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def servers():
    """The module's server (default flags) and one with CORS on, started side by side."""
    started = [Server("--max-model-len", str(MAX_LEN)),
               Server("--max-model-len", "128", "--no-warmup", "--num-blocks", "64", "--allowed-origins", ORIGINS)]
    try:
        yield [s.wait_ready() for s in started]
    finally:
        for s in started:
            s.stop()


@pytest.fixture(scope="module")
def server(servers):
    return servers[0]


@pytest.fixture(scope="module")
def cors_server(servers):
    return servers[1]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def post(server: Server, path: str, body, **kw) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(f"{server.url}{path}", content=body, headers={"content-type": "application/json"},
                          timeout=60, **kw)
    return httpx.post(f"{server.url}{path}", json=body, timeout=60, **kw)


def assert_error(r: httpx.Response, status: int, param: str | None, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def sse_chunks(server: Server, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{server.url}{path}", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [x[6:] for x in r.iter_lines() if x.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


# -- 1. /v1/models/{id} -----------------------------------------------------------------------
def test_models_retrieve_and_unknown_model(server, client):
    listed = client.models.list().data
    assert [m.id for m in listed] == [MODEL]
    assert isinstance(listed[0].created, int) and listed[0].created > 1_600_000_000
    m = client.models.retrieve(MODEL)
    assert (m.id, m.object, m.owned_by, m.created) == (MODEL, "model", "kvos", listed[0].created)
    assert m.model_dump()["max_model_len"] == MAX_LEN
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-17")
    assert e.value.code == "model_not_found"
    err = assert_error(httpx.get(f"{server.url}/v1/models/gpt-17"), 404, "model", "model_not_found")
    assert err["type"] == "invalid_request_error" and "gpt-17" in err["message"]
    assert_error(httpx.get(f"{server.url}/v1/models/org/gpt-17"), 404, "model", "model_not_found")


# -- 2. /version, /tokenize, /detokenize --------------------------------------------------------
def test_version(server):
    import kvos

    r = httpx.get(f"{server.url}/version")
    assert r.status_code == 200 and r.json() == {"version": kvos.__version__}


def test_tokenize_detokenize_round_trip(server, client):
    text = "The capital of France is Paris."
    r = post(server, "/tokenize", {"model": MODEL, "prompt": text, "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["count"] == len(body["tokens"]) > 3 and body["max_model_len"] == MAX_LEN
    assert all(isinstance(t, int) for t in body["tokens"]) and len(body["token_strs"]) == body["count"]
    assert post(server, "/detokenize", {"tokens": body["tokens"]}).json() == {"prompt": text}
    # the count a completion reports is the count /tokenize gives
    done = client.completions.create(model=MODEL, prompt=text, max_tokens=1, temperature=0)
    assert done.usage.prompt_tokens == body["count"]


def test_tokenize_chat_like_vllm(server, client):
    with_prompt = post(server, "/tokenize", {"messages": CHAT}).json()
    without = post(server, "/tokenize", {"messages": CHAT, "add_generation_prompt": False}).json()
    assert with_prompt["count"] > without["count"] > 0
    assert with_prompt["tokens"][:without["count"]] == without["tokens"]
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1, temperature=0)
    assert chat.usage.prompt_tokens == with_prompt["count"]
    text = post(server, "/detokenize", {"tokens": with_prompt["tokens"]}).json()["prompt"]
    assert "Say hi." in text and "<|im_start|>" in text  # special tokens kept: a faithful round trip
    special = post(server, "/tokenize", {"messages": CHAT, "add_special_tokens": True}).json()
    assert special["count"] >= with_prompt["count"]


TOKENIZE_BAD = [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "hi", "messages": CHAT}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ("/tokenize", {"prompt": "hi", "add_special_tokens": "maybe"}, "add_special_tokens"),
    ("/tokenize", {"prompt": "hi", "frobnicate": 1}, "frobnicate"),
    ("/tokenize", json.dumps({"prompt": "\ud800 lone surrogate"}).encode(), "prompt"),
    ("/detokenize", {}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
    ("/detokenize", {"tokens": [1, -1]}, "tokens"),
    ("/detokenize", {"tokens": [10**9]}, "tokens"),
    ("/detokenize", {"tokens": [1.5]}, "tokens.0"),
]


@pytest.mark.parametrize("path, body, param", TOKENIZE_BAD, ids=[f"{p[1:]}-{i}" for i, (p, _, _) in
                                                                 enumerate(TOKENIZE_BAD)])
def test_tokenize_bad_input_names_the_field(server, path, body, param):
    assert_error(post(server, path, body), 400, param)


def test_tokenize_unknown_model_is_404(server):
    assert_error(post(server, "/tokenize", {"model": "gpt-17", "prompt": "hi"}), 404, "model", "model_not_found")
    assert_error(post(server, "/detokenize", {"model": "gpt-17", "tokens": [1]}), 404, "model", "model_not_found")


# -- 3. max_tokens past the context; stream_options without stream ------------------------------
def test_max_tokens_past_the_context_is_a_400(server, client):
    prompt = "Memory pages and blocks. " * 100  # about 500 tokens: the one that fits runs few
    n = post(server, "/tokenize", {"prompt": prompt}).json()["count"]
    assert 400 < n < MAX_LEN - 4
    fits = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_LEN - n, temperature=0)
    assert fits.usage.prompt_tokens == n and fits.usage.completion_tokens <= MAX_LEN - n
    over = MAX_LEN - n + 1
    err = assert_error(post(server, "/v1/completions", {"prompt": prompt, "max_tokens": over}), 400, "max_tokens",
                       "context_length_exceeded")
    assert all(str(x) in err["message"] for x in (n, over, MAX_LEN)), err
    # with several prompts, any one past the context refuses the request (nothing runs)
    assert_error(post(server, "/v1/completions", {"prompt": ["Hi", prompt], "max_tokens": over}), 400, "max_tokens")
    chat_n = post(server, "/tokenize", {"messages": CHAT}).json()["count"]
    for field in ("max_tokens", "max_completion_tokens"):
        err = assert_error(post(server, "/v1/chat/completions", {"messages": CHAT, field: MAX_LEN}), 400, field,
                           "context_length_exceeded")
        assert str(chat_n) in err["message"] and str(MAX_LEN) in err["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=10_000)
    assert e.value.param == "max_completion_tokens"
    # a prompt alone past the context is the prompt's error, context_length_exceeded in every form
    assert_error(post(server, "/v1/completions", {"prompt": "word " * 700, "max_tokens": 10_000}), 400, "prompt",
                 "context_length_exceeded")
    assert_error(post(server, "/v1/completions", {"prompt": [7] * MAX_LEN, "max_tokens": 1}), 400, "prompt",
                 "context_length_exceeded")
    assert_error(post(server, "/v1/completions", {"prompt": [[5, 6], [7] * (MAX_LEN + 3)]}), 400, "prompt",
                 "context_length_exceeded")
    long_chat = [{"role": "user", "content": "word " * 700}]
    assert_error(post(server, "/v1/chat/completions", {"messages": long_chat}), 400, "messages",
                 "context_length_exceeded")


@pytest.mark.parametrize("path, body", [("/v1/completions", {"prompt": "hi"}),
                                        ("/v1/chat/completions", {"messages": CHAT})])
def test_stream_options_need_stream(server, path, body):
    for stream in ({}, {"stream": False}):
        err = assert_error(post(server, path, {**body, **stream, "stream_options": {"include_usage": True}}), 400,
                           "stream_options")
        assert "stream" in err["message"]
    assert post(server, path, {**body, "max_tokens": 1, "stream_options": None}).status_code == 200


# -- 4. schema details ----------------------------------------------------------------------------
def test_fingerprint_and_usage_details(server, client):
    c = client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, temperature=0)
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, temperature=0)
    assert re.fullmatch(r"fp_[0-9a-f]{10}", c.system_fingerprint)
    assert chat.system_fingerprint == c.system_fingerprint
    for u in (c.usage, chat.usage):
        assert u.completion_tokens_details.reasoning_tokens == 0
        assert u.prompt_tokens_details.cached_tokens >= 0
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, temperature=0,
                                                 stream=True))
    assert chunks and {k.system_fingerprint for k in chunks} == {c.system_fingerprint}


def test_x_request_id_on_every_response(server, client):
    mine = {"x-request-id": "load-tool-42"}
    for r in (httpx.get(f"{server.url}/health", headers=mine),
              httpx.get(f"{server.url}/metrics", headers=mine),
              httpx.get(f"{server.url}/nowhere", headers=mine),
              post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 0}, headers=mine),
              post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 1}, headers=mine)):
        assert r.headers["x-request-id"] == "load-tool-42", (r.request.url, r.status_code)
    ids = {httpx.get(f"{server.url}/v1/models").headers["x-request-id"] for _ in range(3)}
    assert len(ids) == 3 and all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids)
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=CHAT, max_tokens=1,
                                                           extra_headers={"X-Request-Id": "chat-7"})
    assert raw.headers["x-request-id"] == "chat-7" and raw.parse().choices[0].message.role == "assistant"
    with httpx.stream("POST", f"{server.url}/v1/completions", headers=mine, timeout=60,
                      json={"prompt": "hi", "max_tokens": 2, "stream": True}) as r:
        assert r.headers["x-request-id"] == "load-tool-42"
        r.read()


@pytest.mark.parametrize("path, body", [("/v1/completions", {"prompt": "Once upon a time", "n": 2}),
                                        ("/v1/chat/completions", {"messages": CHAT})])
def test_stream_usage_null_then_final_usage(server, path, body):
    body = {**body, "max_tokens": 5, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    chunks = sse_chunks(server, path, body)
    *content, final = chunks
    assert content and all("usage" in k and k["usage"] is None for k in content)
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 5 * body.get("n", 1)
    assert final["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}
    assert {k["system_fingerprint"] for k in chunks} == {chunks[0]["system_fingerprint"]}
    plain = sse_chunks(server, path, {**body, "stream_options": None})
    assert all("usage" not in k for k in plain)


@pytest.mark.parametrize("path, body", [("/v1/completions", {"prompt": "Once upon a time"}),
                                        ("/v1/chat/completions", {"messages": CHAT})])
def test_stream_continuous_usage_stats(server, path, body):
    body = {**body, "max_tokens": 5, "temperature": 0, "ignore_eos": True, "stream": True}
    only = sse_chunks(server, path, {**body, "stream_options": {"continuous_usage_stats": True}})
    assert all(k["usage"] is not None and k["choices"] for k in only)  # usage everywhere, no usage-only chunk
    counts = [k["usage"]["completion_tokens"] for k in only]
    assert counts == sorted(counts) and counts[-1] == 5
    assert {k["usage"]["prompt_tokens"] for k in only} == {only[0]["usage"]["prompt_tokens"]}
    both = sse_chunks(server, path, {**body, "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    assert both[-1]["choices"] == [] and both[-1]["usage"] == both[-2]["usage"]


def test_negative_seeds(server, client):
    def run(seed):
        return client.completions.create(model=MODEL, prompt="A random word:", max_tokens=4, temperature=1.0,
                                         seed=seed).choices[0].text

    for seed in (-1, -(2**63)):
        assert run(seed) == run(seed)
    assert run(-5) == run(-5 % 2**63)  # the engine's domain: seed mod 2**63
    for seed in (2**63, -(2**63) - 1):
        assert_error(post(server, "/v1/completions", {"prompt": "hi", "seed": seed}), 400, "seed")
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=1.0, seed=-7, n=2)
    assert len(chat.choices) == 2


# -- 5. CORS ----------------------------------------------------------------------------------
PREFLIGHT = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}


def test_cors_is_off_by_default(server):
    r = httpx.options(f"{server.url}/v1/chat/completions", headers={"Origin": "https://a.example", **PREFLIGHT})
    assert not any(k.lower().startswith("access-control-") for k in r.headers), r.headers
    r = httpx.get(f"{server.url}/v1/models", headers={"Origin": "https://a.example"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_cors_allowed_origins(cors_server):
    url = f"{cors_server.url}/v1/chat/completions"
    for origin in ORIGINS.split(","):
        r = httpx.options(url, headers={"Origin": origin, **PREFLIGHT})
        assert r.status_code == 200, r.text
        assert r.headers["access-control-allow-origin"] == origin
        assert "POST" in r.headers["access-control-allow-methods"]
        assert "authorization" in r.headers["access-control-allow-headers"].lower()
    r = httpx.options(url, headers={"Origin": "https://evil.example", **PREFLIGHT})
    assert r.status_code >= 400 and "access-control-allow-origin" not in r.headers
    r = httpx.post(url, headers={"Origin": "https://b.example"}, timeout=60,
                   json={"messages": CHAT, "max_tokens": 1})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://b.example"
    assert "x-request-id" in r.headers["access-control-expose-headers"].lower()


# -- 6. a client that disconnects from a non-streaming request --------------------------------
def test_disconnect_of_a_non_streaming_request_is_quiet_and_frees_blocks(server):
    def aborted() -> float:
        try:
            return server.metric("kvos:request_success_total", 'finished_reason="abort"')
        except KeyError:
            return 0.0

    before, log_start = aborted(), len(server.output())
    body = {"prompt": "Write a very long story about paging.", "max_tokens": 480, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, headers={"x-request-id": "gone-1"},
                   timeout=httpx.Timeout(30, read=1.5))
    end = time.monotonic() + 20
    while time.monotonic() < end and not (aborted() > before
                                          and server.metric("kvos:kv_cache_blocks", 'state="used"') == 0):
        time.sleep(0.2)
    assert aborted() == before + 1
    assert server.metric("kvos:kv_cache_blocks", 'state="used"') == 0
    assert server.metric("kvos:num_requests_running") == 0
    log = server.output()[log_start:]
    for bad in ("Traceback", "Exception in ASGI application", "never retrieved", "ERROR"):
        assert bad not in log, log
    lines = [x for x in log.splitlines() if "disconnected" in x]
    assert len(lines) == 1 and " INFO " in lines[0] and "gone-1" in lines[0], log
    r = post(server, "/v1/completions", {"prompt": "Still there?", "max_tokens": 2})
    assert r.status_code == 200


def test_invocations_routes_chat_and_completion_bodies(server):
    """``/invocations`` (SageMaker's, vLLM's): the same answers as the two endpoints, the same
    400s naming the field."""
    chat = {"messages": CHAT, "max_tokens": 4, "temperature": 0}
    a, b = post(server, "/invocations", chat), post(server, "/v1/chat/completions", chat)
    assert a.status_code == b.status_code == 200, a.text
    assert a.json()["object"] == "chat.completion"
    assert a.json()["choices"][0]["message"] == b.json()["choices"][0]["message"]
    comp = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    a, b = post(server, "/invocations", comp), post(server, "/v1/completions", comp)
    assert a.json()["object"] == "text_completion" and a.json()["choices"][0]["text"] == b.json()["choices"][0]["text"]
    assert_error(post(server, "/invocations", {"max_tokens": 3}), 400, "messages")
    assert_error(post(server, "/invocations", {"prompt": "hi", "max_tokens": 0}), 400, "max_tokens")
    assert_error(post(server, "/invocations", {"messages": CHAT, "frobnicate": 1}), 400, "frobnicate")
    assert_error(post(server, "/invocations", b"{not json"), 400, None, "invalid_json")
