"""The OpenAI-compatible FastAPI app."""
from __future__ import annotations

import asyncio
import contextlib
import copy
import hashlib
import logging
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvos.engine.chat import chat_prompt_ids, has_chat_template
from kvos.engine.llm_engine import LLMEngine
from kvos.engine.sampling_params import SamplingParams
from kvos.serve.async_engine import AsyncEngine, RequestStream
from kvos.serve.errors import APIError, install_error_handlers
from kvos.serve.metrics import ServerMetrics
from kvos.serve.protocol import ChatCompletionRequest, CompletionRequest
from kvos.serve.responses import (LogprobFormatter, chat_body, completion_body, finish_reason, sse,
                                  usage)

log = logging.getLogger("kvos.serve")

WARMUP_PROMPTS = ["Hello", "The capital of France is"]


class ServerState:
    def __init__(self, engine: LLMEngine, model_name: str, api_keys: list[str], max_waiting: int) -> None:
        self.engine = engine
        self.async_engine = AsyncEngine(engine)
        self.model_name = model_name
        self.api_keys = {k: hashlib.sha256(k.encode()).hexdigest()[:32] for k in api_keys}
        self.max_waiting = max_waiting
        self.metrics = ServerMetrics(self._stats)
        # fast tokenizers are not thread-safe: the event loop gets its own instance, the engine
        # thread keeps the engine's
        self.tokenizer = copy.deepcopy(engine.tokenizer)
        self.logprobs = LogprobFormatter(self.tokenizer)
        self.ready = False
        self.draining = False

    def _stats(self) -> dict:
        s = self.engine.stats()
        s["waiting"] += self.async_engine.num_pending
        return s


def create_app(engine: LLMEngine, model_name: str, api_keys: list[str] | None = None,
               max_waiting: int = 256, warmup: bool = True) -> FastAPI:
    if engine.tokenizer is None:
        raise ValueError("model: serving needs a tokenizer; this random-weight model has none "
                         "(put tokenizer files beside its config.json)")
    state = ServerState(engine, model_name, api_keys or [], max_waiting)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        state.async_engine.start()
        task = asyncio.create_task(_warm_up(state) if warmup else _mark_ready(state))
        yield
        state.draining = True
        await state.async_engine.drain(timeout=60)
        task.cancel()
        state.async_engine.shutdown()

    app = FastAPI(title="kvos", version="0.1.0", lifespan=lifespan)
    app.state.kvos = state
    install_error_handlers(app)

    @app.get("/health")
    async def health():
        if state.ready and not state.draining:
            return {"status": "ok"}
        return JSONResponse({"status": "draining" if state.draining else "warming_up"}, status_code=503)

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(_auth(state))])

    @v1.get("/models")
    async def models():
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": 0,
                                            "owned_by": "kvos", "max_model_len": engine.max_model_len}]}

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request):
        _admit(state, body.model)
        params = body.sampling_params(body.max_tokens, body.logprobs)
        rid = f"cmpl-{uuid.uuid4().hex}"
        streams = await _submit_all(state, body.prompts(), params, rid, body.priority,
                                    _salt(request, body.cache_salt))
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return _sse_response(_completion_chunks(state, rid, streams, params.n, include_usage))
        outs = await _collect(request, streams)
        _observe(state, streams)
        return completion_body(rid, state.model_name, outs, params.n, state.logprobs)

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        _admit(state, body.model)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        ids = chat_prompt_ids(state.tokenizer, messages)
        top_n = body.top_logprobs or 0
        params = body.sampling_params(body.effective_max_tokens(), body.effective_logprobs())
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        streams = await _submit_all(state, [{"prompt_token_ids": ids}], params, rid, body.priority,
                                    _salt(request, body.cache_salt))
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return _sse_response(_chat_chunks(state, rid, streams[0], include_usage, top_n))
        outs = await _collect(request, streams)
        _observe(state, streams)
        return chat_body(rid, state.model_name, outs[0], state.logprobs, top_n)

    app.include_router(v1)
    return app


# -- helpers ------------------------------------------------------------------------------
async def _mark_ready(state: ServerState) -> None:
    state.ready = True


async def _warm_up(state: ServerState) -> None:
    """Run a few requests through the whole pipeline (tokenizer, scheduler, model, sampler,
    detokenizer) before reporting ready."""
    try:
        params = SamplingParams(temperature=0, max_tokens=4)
        prompts = list(WARMUP_PROMPTS)
        if has_chat_template(state.tokenizer):  # a base model has none
            prompts.append({"prompt_token_ids": chat_prompt_ids(state.tokenizer, [{"role": "user", "content": "Hi"}])})
        streams = [await state.async_engine.submit(p, params, f"warmup-{i}", cache_salt="kvos-warmup")
                   for i, p in enumerate(prompts)]
        await asyncio.gather(*(s.result() for s in streams))
        state.ready = True
        log.info("warm-up done; ready")
    except Exception:
        log.exception("warm-up failed")


def _auth(state: ServerState):
    async def check(request: Request) -> None:
        if not state.api_keys:
            return
        header = request.headers.get("authorization", "")
        key = header[7:] if header.lower().startswith("bearer ") else None
        if key not in state.api_keys:
            raise APIError(401, "Invalid or missing API key (send Authorization: Bearer KEY)",
                           code="invalid_api_key")
        request.state.tenant = state.api_keys[key]
    return check


def _salt(request: Request, cache_salt: str | None) -> str | None:
    """Tenant isolation: the API key's tenant (when keys are configured) and the body's
    ``cache_salt`` both go into the root of every block hash."""
    tenant = getattr(request.state, "tenant", None)
    if tenant is None:
        return cache_salt
    return f"{tenant}:{cache_salt or ''}"


def _admit(state: ServerState, model: str | None) -> None:
    if state.draining:
        raise APIError(503, "server is shutting down", "service_unavailable", code="draining")
    if model is not None and model != state.model_name:
        raise APIError(404, f"The model `{model}` does not exist (this server serves `{state.model_name}`)",
                       param="model", code="model_not_found")
    if state.async_engine.num_pending >= state.max_waiting:
        state.metrics.rejected.labels("429").inc()
        raise APIError(429, f"too many waiting requests ({state.max_waiting}); retry later",
                       "rate_limit_error", code="queue_full", headers={"Retry-After": "1"})


async def _submit_all(state: ServerState, prompts: list, params: SamplingParams, rid: str, priority: int,
                      salt: str | None) -> list[RequestStream]:
    streams: list[RequestStream] = []
    try:
        for i, prompt in enumerate(prompts):
            streams.append(await state.async_engine.submit(prompt, params, f"{rid}-{i}", priority, salt))
    except BaseException:
        for s in streams:
            await s.aclose()
        raise
    return streams


async def _collect(request: Request, streams: list[RequestStream]):
    """Wait for every stream; abort them all if the client goes away first."""
    work = asyncio.ensure_future(asyncio.gather(*(s.result() for s in streams)))
    try:
        while True:
            done, _ = await asyncio.wait({work}, timeout=0.5)
            if done:
                return work.result()
            if await request.is_disconnected():
                raise asyncio.CancelledError("client disconnected")
    finally:
        if not work.done():
            work.cancel()
            for s in streams:
                await s.aclose()


def _observe(state: ServerState, streams: list[RequestStream]) -> None:
    now = time.monotonic()
    for s in streams:
        out = s.last
        if out is None:
            continue
        c = out.outputs[0]
        state.metrics.observe(len(out.prompt_token_ids), s.arrival, s.first_output_time, now,
                              len(c.token_ids), finish_reason(c) or "abort")


def _sse_response(gen: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(gen, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, object]]:
    """Interleave several request streams as (prompt index, output)."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            async for out in s:
                await queue.put((i, out))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    live = len(tasks)
    try:
        while live:
            i, out = await queue.get()
            if out is None:
                live -= 1
            else:
                yield i, out
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            await s.aclose()


async def _completion_chunks(state: ServerState, rid: str, streams: list[RequestStream], n: int,
                             include_usage: bool) -> AsyncIterator[str]:
    created, model = int(time.time()), state.model_name
    sent_text: dict[tuple[int, int], int] = {}
    sent_tokens: dict[tuple[int, int], int] = {}
    finished: set[tuple[int, int]] = set()
    last = {}
    try:
        async for i, out in _merge(streams):
            last[i] = out
            for c in out.outputs:
                key = (i, c.index)
                if key in finished:
                    continue
                t0, k0 = sent_text.get(key, 0), sent_tokens.get(key, 0)
                delta = c.text[t0:]
                reason = finish_reason(c)
                if not delta and reason is None:
                    continue
                sent_text[key], sent_tokens[key] = len(c.text), len(c.token_ids)
                choice = {"index": i * n + c.index, "text": delta,
                          "logprobs": state.logprobs.completion(c, k0, t0), "finish_reason": reason}
                if reason is not None:
                    finished.add(key)
                yield sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                           "choices": [choice]})
        if include_usage:
            yield sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                       "choices": [], "usage": usage([last[i] for i in sorted(last)])})
        yield sse("[DONE]")
    finally:
        _observe(state, streams)


async def _chat_chunks(state: ServerState, rid: str, stream: RequestStream, include_usage: bool,
                       top_n: int) -> AsyncIterator[str]:
    created, model = int(time.time()), state.model_name
    base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
    sent_text: dict[int, int] = {}
    sent_tokens: dict[int, int] = {}
    finished: set[int] = set()
    try:
        async for out in stream:
            for c in out.outputs:
                if c.index in finished:
                    continue
                if c.index not in sent_text:
                    sent_text[c.index] = sent_tokens[c.index] = 0
                    yield sse({**base, "choices": [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                                    "logprobs": None, "finish_reason": None}]})
                t0, k0 = sent_text[c.index], sent_tokens[c.index]
                delta, reason = c.text[t0:], finish_reason(c)
                if delta or len(c.token_ids) > k0:
                    sent_text[c.index], sent_tokens[c.index] = len(c.text), len(c.token_ids)
                    yield sse({**base, "choices": [{"index": c.index, "delta": {"content": delta},
                                                    "logprobs": state.logprobs.chat(c, k0, top_n),
                                                    "finish_reason": None}]})
                if reason is not None:
                    finished.add(c.index)
                    yield sse({**base, "choices": [{"index": c.index, "delta": {}, "logprobs": None,
                                                    "finish_reason": reason}]})
        if include_usage and stream.last is not None:
            yield sse({**base, "choices": [], "usage": usage([stream.last])})
        yield sse("[DONE]")
    finally:
        _observe(state, [stream])
