"""``kvos serve`` against hostile or unlucky clients (issue #14): body and header limits, prompts
that cannot fit, tokenization off the event loop, slow clients, the banner, graceful shutdown.

Structural checks only (no timing assertions): the inter-token gap figures are measured by
``benchmarks/`` scripts, not here."""
from __future__ import annotations

import json
import select
import signal
import socket
import time

import httpx
import pytest

from tests.support.server import Server

KEY = "sk-kvos-hardening-secret-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_BYTES = 2 << 20
MAX_LEN = 256


@pytest.fixture(scope="module")
def server():
    s = Server("--max-model-len", str(MAX_LEN), "--no-warmup", "--api-key", KEY,
               "--max-request-bytes", str(MAX_BYTES), "--max-header-bytes", "8192",
               "--request-timeout-s", "2").wait_ready()
    yield s
    s.stop()


def post(server: Server, path: str, body, **kw) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=AUTH, timeout=60, **kw)


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:500])
    return r.json()["error"]


def connect(server: Server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=10)


def read_until_closed(sock: socket.socket, timeout: float) -> bytes:
    """All the server sends until it closes the connection (or ``timeout``: then what came)."""
    data, end = b"", time.monotonic() + timeout
    while time.monotonic() < end:
        ready, _, _ = select.select([sock], [], [], max(0.0, end - time.monotonic()))
        if not ready:
            break
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return data + b"<reset>"
        if not chunk:
            return data + b"<closed>"
        data += chunk
    return data


# -- 11a: the banner ---------------------------------------------------------------------------
def test_banner_does_not_print_the_api_key(server):
    out = server.output()
    assert "kvos is serving" in out and KEY not in out and KEY[-4:] in out


# -- 1: body size, prompts that cannot fit, tokenization off the event loop --------------------
def test_body_over_the_limit_is_413_naming_the_option(server):
    big = {"model": "x", "prompt": "a" * (MAX_BYTES + 1000), "max_tokens": 1}
    err = error_of(post(server, "/v1/completions", big), 413)
    assert err["code"] == "request_too_large" and "--max-request-bytes" in err["message"]
    assert str(MAX_BYTES) in err["message"]
    # chunked (no Content-Length): refused once the bytes received pass the limit
    payload = json.dumps(big).encode()
    chunks = (payload[i:i + 65536] for i in range(0, len(payload), 65536))
    r = httpx.post(f"{server.url}/v1/completions", content=chunks, timeout=60,
                   headers={**AUTH, "content-type": "application/json"})
    assert error_of(r, 413)["code"] == "request_too_large"
    # a Content-Length past the limit is refused before a byte of the body is sent
    with connect(server) as s:
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {10 ** 9}\r\n\r\n".encode())
        assert read_until_closed(s, 10).startswith(b"HTTP/1.1 413")
    assert httpx.get(f"{server.url}/health").status_code == 200


@pytest.mark.parametrize("chunked", [False, True])
def test_a_body_of_exactly_the_limit_is_accepted_and_one_byte_more_is_not(server, chunked):
    """The limit is inclusive: ``--max-request-bytes`` bytes are parsed (here a prompt too long for
    the context: 400), one more byte is 413, with a Content-Length and chunked."""
    def body(size: int) -> bytes:
        head = b'{"max_tokens": 1, "prompt": "'
        return head + b"a" * (size - len(head) - 2) + b'"}'

    for size, status in ((MAX_BYTES, 400), (MAX_BYTES + 1, 413)):
        payload = body(size)
        assert len(payload) == size
        content = (payload[i:i + 65536] for i in range(0, size, 65536)) if chunked else payload
        r = httpx.post(f"{server.url}/v1/completions", content=content, timeout=60,
                       headers={**AUTH, "content-type": "application/json"})
        assert r.status_code == status, (size, r.status_code, r.text[:300])
        if status == 400:
            assert r.json()["error"]["code"] == "context_length_exceeded"


def test_tokenize_is_bounded_like_generation(server):
    """Four concurrent /tokenize calls of text too large for the context by its size alone are
    400s naming the field at once (nothing is tokenized), as generation's are."""
    import asyncio

    text = "lorem ipsum " * 150_000

    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=60) as client:
            bodies = [{"prompt": text}] * 3 + [{"messages": [{"role": "user", "content": text}]}]
            return await asyncio.gather(*(client.post("/tokenize", json=b) for b in bodies))

    for r, param in zip(asyncio.run(main()), ["prompt"] * 3 + ["messages"]):
        err = error_of(r, 400)
        assert err["param"] == param and err["code"] == "context_length_exceeded", err
    ok = post(server, "/tokenize", {"prompt": "Hello there"})
    assert ok.status_code == 200 and ok.json()["count"] > 0


def test_prompt_that_cannot_fit_is_refused_without_tokenizing(server):
    text = "lorem ipsum " * 150_000  # 1.8 MB: too many bytes for MAX_LEN tokens of any kind
    err = error_of(post(server, "/v1/completions", {"prompt": text, "max_tokens": 1}), 400)
    assert err["param"] == "prompt" and err["code"] == "context_length_exceeded"
    assert "at least" in err["message"] and "bytes" in err["message"], err  # the size bound, not a token count
    err = error_of(post(server, "/v1/completions", {"prompt": ["Hi", text], "max_tokens": 1}), 400)
    assert err["param"] == "prompt" and "at least" in err["message"]
    err = error_of(post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": text}],
                                                         "max_tokens": 1}), 400)
    assert err["param"] == "messages" and "at least" in err["message"], err
    # short in bytes but long in tokens: tokenized (on a worker thread), then refused by its count
    err = error_of(post(server, "/v1/completions", {"prompt": "word " * (MAX_LEN + 50), "max_tokens": 1}), 400)
    assert err["param"] == "prompt" and f"max_model_len is {MAX_LEN}" in err["message"]
    assert "at least" not in err["message"]
    r = post(server, "/v1/completions", {"prompt": "The capital of France is", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


# -- 6: slow clients, oversized headers --------------------------------------------------------
def test_incomplete_requests_are_timed_out(server):
    half_header = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-"
    half_body = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 1000\r\n\r\n{\"prompt\": \"hel")
    socks = [connect(server) for _ in range(21)]
    for i, s in enumerate(socks):
        if i % 3 == 1:
            s.sendall(half_header)
        elif i % 3 == 2:
            s.sendall(half_body)  # i % 3 == 0: connects and sends nothing
    try:
        end = time.monotonic() + 15  # the server's timeout is 2 s
        results = [read_until_closed(s, end - time.monotonic()) for s in socks]
    finally:
        for s in socks:
            s.close()
    assert all(r.endswith((b"<closed>", b"<reset>")) for r in results), results
    assert all(r.startswith(b"HTTP/1.1 408") for r in results), results
    assert b"--request-timeout-s" in results[1]
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_oversized_header_is_431(server):
    with connect(server) as s:  # a whole header block past the limit
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20_000 + b"\r\n\r\n")
        r = read_until_closed(s, 10)
        assert r.startswith(b"HTTP/1.1 431") and b"--max-header-bytes" in r, r[:300]
    with connect(server) as s:  # headers that never end
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X-Pad: aaaaaaaaaaaaaaaa\r\n" * 1000)
        assert read_until_closed(s, 10).startswith(b"HTTP/1.1 431")
    # a header block under the limit is served
    r = httpx.get(f"{server.url}/health", headers={"X-Ok": "a" * 4000})
    assert r.status_code == 200


# -- 8: shutdown -------------------------------------------------------------------------------
def test_sigterm_drains_then_cuts_streams_and_exits_0():
    s = Server("--max-model-len", "1024", "--no-warmup", "--shutdown-timeout-s", "2").wait_ready()
    try:
        body = {"prompt": "Once upon a time", "max_tokens": 900, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=60) as c, c.stream("POST", f"{s.url}/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            events = [next(e for e in lines if e.startswith("data: "))]  # the stream is running
            s.proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            health = httpx.get(f"{s.url}/health", timeout=10)  # the listener stays open while draining
            assert health.status_code == 503 and health.json() == {"status": "draining"}
            late = httpx.post(f"{s.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=10)
            assert late.status_code == 503 and late.json()["error"]["code"] == "draining"
            events += [e for e in lines if e.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        last = json.loads(events[-2].removeprefix("data: "))
        # cut at the deadline (an error event naming the option), or finished in time
        assert ("error" in last and last["error"]["code"] == "draining"
                and "--shutdown-timeout-s" in last["error"]["message"]) or \
            last["choices"][0]["finish_reason"] == "length", last
        assert s.proc.wait(60) == 0
    finally:
        s.stop()
