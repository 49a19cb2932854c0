"""Request limits, slow-client timeouts, off-loop tokenization and graceful shutdown for ``kvos serve``.

* ``BodyLimitMiddleware``: a body over ``--max-request-bytes`` gets 413 before anything parses it.
* ``GuardedHttpToolsProtocol``: a request whose header and body have not fully arrived within
  ``--request-timeout-s`` gets 408 and its connection is closed; a header block over
  ``--max-header-bytes`` gets 431.
* ``TokenizerPool``: tokenization on worker threads, never on the event loop or the engine thread.
* ``min_prompt_tokens``: a lower bound on a text's token count from its size, so a prompt that
  cannot fit the context is refused without tokenizing it.
* ``DrainingServer``: SIGTERM first drains (``/health`` says 503 meanwhile, the listener stays
  open), cuts what is left at ``--shutdown-timeout-s``, then stops uvicorn; the exit status is 0.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import queue
import signal
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import uvicorn

log = logging.getLogger("kvos.serve")
T = TypeVar("T")

from kvos.serve.defaults import (  # noqa: F401  (re-exported)
    DEFAULT_MAX_HEADER_BYTES,
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_REQUEST_TIMEOUT_S,
    DEFAULT_SHUTDOWN_TIMEOUT_S,
)


def _error_body(message: str, code: str, type_: str = "invalid_request_error") -> bytes:
    return json.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}}).encode()


# -- body size ----------------------------------------------------------------------------
class BodyLimitMiddleware:
    """Refuses a request body over ``max_bytes`` with 413 and an OpenAI-style error naming
    ``--max-request-bytes``: at once when ``Content-Length`` says so, else as soon as the chunks
    received pass it. The body is read whole here (FastAPI reads it whole anyway) and replayed to
    the app; later ``receive`` calls (disconnect checks) go to the server."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._reject(send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client went away mid-body: nobody to answer
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                await self._reject(send)
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        await self.app(scope, replay, send)

    async def _reject(self, send) -> None:
        body = _error_body(f"request body is larger than this server's limit of {self.max_bytes} bytes "
                           f"(--max-request-bytes)", "request_too_large")
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


# -- slow clients and oversized headers ----------------------------------------------------
try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # httptools missing: uvicorn's h11 (header limit: 400, no request timeout)
    HttpToolsProtocol = None  # type: ignore[assignment,misc]


def _raw_response(status: int, reason: str, message: str, code: str) -> bytes:
    body = _error_body(message, code)
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"connection: close\r\n\r\n").encode() + body


def guarded_protocol(request_timeout_s: float, max_header_bytes: int) -> type | None:
    """uvicorn's httptools protocol with a deadline per request and a header size limit (None
    when httptools is not installed).

    Contract: from the connection's start, and from each later request's first byte, the whole
    request (request line, headers, body) must arrive within ``request_timeout_s``, else the client
    gets 408 (unless a response already started) and the connection closes. Streaming responses
    are not limited: the deadline ends when the request is fully received. A request line plus
    headers over ``max_header_bytes`` gets 431 and the connection closes. Idle keep-alive
    connections stay uvicorn's (``--timeout-keep-alive``)."""
    if HttpToolsProtocol is None:
        return None

    class GuardedHttpToolsProtocol(HttpToolsProtocol):
        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._kvos_deadline: asyncio.TimerHandle | None = None
            self._kvos_rejected = False
            self._kvos_in_headers = True  # between a message's start and its headers' end
            self._kvos_header_bytes = 0  # bytes fed while in the header phase (an upper bound)
            self._kvos_header_size = 0  # exact: request line plus headers as parsed
            self._kvos_arm()

        def connection_lost(self, exc) -> None:
            self._kvos_disarm()
            super().connection_lost(exc)

        def _kvos_arm(self) -> None:
            self._kvos_disarm()
            self._kvos_deadline = self.loop.call_later(request_timeout_s, self._kvos_expired)

        def _kvos_disarm(self) -> None:
            if self._kvos_deadline is not None:
                self._kvos_deadline.cancel()
                self._kvos_deadline = None

        def _kvos_close(self, status: int, reason: str, message: str, code: str) -> None:
            """Answer ``status`` (when no response started) and close; the app sees a disconnect."""
            self._kvos_rejected = True
            self._kvos_disarm()
            cycle = self.cycle  # None, this request's, or (header phase) the previous one's
            started = cycle is not None and cycle.response_started and not cycle.response_complete
            if cycle is not None and not cycle.response_complete:
                cycle.disconnected = True  # the app must not write after our answer
                cycle.message_event.set()
            if not started and not self.transport.is_closing():
                self.transport.write(_raw_response(status, reason, message, code))
            self.transport.close()

        def _kvos_expired(self) -> None:
            self._kvos_deadline = None
            if self.transport.is_closing():
                return
            log.info("closing a connection whose request did not arrive within %ss (--request-timeout-s)",
                        request_timeout_s)
            self._kvos_close(408, "Request Timeout", f"the request did not arrive within {request_timeout_s:g} s "
                             f"(--request-timeout-s)", "request_timeout")

        def _kvos_too_large_header(self) -> None:
            self._kvos_close(431, "Request Header Fields Too Large", f"the request line and headers are larger "
                             f"than this server's limit of {max_header_bytes} bytes (--max-header-bytes)",
                             "headers_too_large")

        def data_received(self, data: bytes) -> None:
            if self._kvos_rejected:
                return
            if self._kvos_in_headers:
                self._kvos_header_bytes += len(data)
            super().data_received(data)
            if self._kvos_in_headers and not self._kvos_rejected and self._kvos_header_bytes > max_header_bytes:
                self._kvos_too_large_header()  # headers still incomplete past the limit

        def on_message_begin(self) -> None:
            if self._kvos_rejected:
                return
            super().on_message_begin()
            self._kvos_in_headers = True
            self._kvos_header_size = 0
            if self._kvos_deadline is None:  # a later request on a kept-alive connection
                self._kvos_arm()

        def on_url(self, url: bytes) -> None:
            if not self._kvos_rejected:
                self._kvos_header_size += len(url) + 16
                super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            if not self._kvos_rejected:
                self._kvos_header_size += len(name) + len(value) + 4
                super().on_header(name, value)

        def on_headers_complete(self) -> None:
            if self._kvos_rejected:
                return
            if self._kvos_header_size > max_header_bytes:
                self._kvos_too_large_header()
                return
            self._kvos_in_headers = False
            self._kvos_header_bytes = 0
            super().on_headers_complete()

        def on_body(self, body: bytes) -> None:
            if not self._kvos_rejected:
                super().on_body(body)

        def on_message_complete(self) -> None:
            if self._kvos_rejected:
                return
            self._kvos_disarm()  # fully received: the response may take as long as it takes
            self._kvos_in_headers, self._kvos_header_bytes = True, 0  # what follows is the next request
            super().on_message_complete()

    return GuardedHttpToolsProtocol


# -- tokenization off the event loop -------------------------------------------------------
def _lower_priority() -> None:
    """Worker threads run at a lower CPU priority (Linux: per-thread nice) so that tokenizing a
    large prompt does not slow the engine's steps."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):
        pass


class TokenizerPool:
    """Runs tokenizer work on ``workers`` threads, each call with a tokenizer copy of its own
    (fast tokenizers are not safe to share across threads). Hugging Face tokenizers release the
    GIL while encoding, so the event loop and the engine thread keep running meanwhile."""

    def __init__(self, tokenizer, copy_fn: Callable[[Any], Any], workers: int = 2) -> None:
        self._free: queue.SimpleQueue = queue.SimpleQueue()
        for _ in range(workers):
            self._free.put(copy_fn(tokenizer))
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="kvos-tokenize", initializer=_lower_priority)

    def _run(self, fn: Callable[[Any], T]) -> T:
        tok = self._free.get()
        try:
            return fn(tok)
        finally:
            self._free.put(tok)

    async def run(self, fn: Callable[[Any], T]) -> T:
        """``fn(tokenizer)`` on a worker thread; its result or its exception."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._run, fn)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def max_token_bytes(tokenizer) -> int | None:
    """The most UTF-8 bytes of (normalized) text one token can stand for, or None when no such
    bound is known (then a prompt's size says nothing about its token count).

    Known: a BPE model (byte-level, byte fallback, or at most one character per unknown token)
    behind no normalizer or one that never shrinks text (``Prepend``; ``Replace`` by something no
    shorter). A byte-level token's string has one character per byte; any other token's string is
    the text it matches (byte-fallback tokens ``<0x41>`` over-count, which is safe)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        spec = json.loads(backend.to_str())
    except Exception:
        return None
    if (spec.get("model") or {}).get("type") != "BPE" or not _never_shrinks(spec.get("normalizer")):
        return None
    byte_level = "ByteLevel" in json.dumps(spec.get("pre_tokenizer"))
    added = {t["content"] for t in spec.get("added_tokens", [])}
    longest = max((len(t) if byte_level else len(t.encode()) for t in spec["model"].get("vocab", {})), default=1)
    return max(longest, 4, *(len(t.encode()) for t in added))


def _never_shrinks(normalizer: dict | None) -> bool:
    if normalizer is None:
        return True
    kind = normalizer.get("type")
    if kind == "Sequence":
        return all(_never_shrinks(n) for n in normalizer.get("normalizers", []))
    if kind == "Prepend":
        return True
    if kind == "Replace":
        pattern = normalizer.get("pattern", {})
        return "String" in pattern and len(normalizer.get("content", "").encode()) >= len(pattern["String"].encode())
    return False


def min_prompt_tokens(text: str, token_bytes: int | None) -> int:
    """At least how many tokens ``text`` becomes: ceil(UTF-8 bytes / ``token_bytes``) (0 when
    no bound is known). Costs one pass over the text, no tokenization."""
    if not token_bytes or not text:
        return 0
    return -(-len(text.encode("utf-8", "surrogatepass")) // token_bytes)


# -- graceful shutdown ---------------------------------------------------------------------
class DrainingServer(uvicorn.Server):
    """A uvicorn server whose first SIGTERM/SIGINT runs ``drain`` before uvicorn stops.

    Meanwhile the listener stays open (``/health`` can answer 503, new work gets 503); when
    ``drain`` returns, uvicorn shuts down as usual and ``run`` returns, exit status 0. A second
    signal stops at once (uvicorn's forced exit, the signal re-raised)."""

    def __init__(self, config: uvicorn.Config, drain: Callable[[], Awaitable[None]]) -> None:
        super().__init__(config)
        self._drain = drain
        self._draining: asyncio.Task | None = None

    def handle_exit(self, sig: int, frame) -> None:
        if self._draining is not None or self.should_exit:
            super().handle_exit(sig, frame)  # a second signal: uvicorn's (forced) exit
            self.force_exit = True
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            super().handle_exit(sig, frame)
            return
        log.info("got %s; draining", signal.Signals(sig).name)
        self._draining = loop.create_task(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            await self._drain()
        except Exception:
            log.exception("drain failed")
        finally:
            self.should_exit = True
