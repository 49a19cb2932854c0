"""The OpenAI-compatible FastAPI app."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import time
import uuid

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError

import kvos
from kvos.cache.pins import PinInfo
from kvos.core.sampling_params import SamplingParams
from kvos.engine.chat import (
    chat_prompt_ids,
    has_chat_template,
    split_image_parts,
)
from kvos.engine.client import EngineClient, EngineStopped, RequestFailed
from kvos.engine.llm_engine import encode_segments, truncate_prompt
from kvos.engine.media import expand_image_text
from kvos.serve.admin import add_admin_routes
from kvos.serve.chat_tools import ChatTools
from kvos.serve.errors import APIError, clip, error_response, install_error_handlers
from kvos.serve.generation import (
    ClientDisconnected,
    admit,
    chat_ids_and_spans,
    check_length,
    check_model,
    collect,
    request_salt,
    submit_all,
    user_text,
)
from kvos.serve.kv_summary import kv_summary_router
from kvos.serve.limits import (
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_SHUTDOWN_TIMEOUT_S,
    BodyLimitMiddleware,
)
from kvos.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    PinRequest,
    TokenizeRequest,
)
from kvos.serve.responses import (
    chat_body,
    completion_body,
)
from kvos.serve.responses_api import responses_router
from kvos.serve.state import ServerState
from kvos.serve.streaming import (
    UsageMode,
    chat_chunks,
    completion_chunks,
    observe_finished,
    sse_response,
)

log = logging.getLogger("kvos.serve")

WARMUP_PROMPTS = ["Hello", "The capital of France is"]

def parse_allowed_origins(value: str) -> list[str]:
    """``"https://a.example,https://b.example"`` or ``"*"`` -> the list CORSMiddleware takes."""
    origins = [o.strip().rstrip("/") for o in value.split(",") if o.strip()]
    for o in origins:
        if o != "*" and not (o.startswith(("http://", "https://")) and "/" not in o.split("://", 1)[1]):
            raise ValueError(f"{o!r} is not an origin like https://app.example (or *)")
    return origins


def allowed_origins_arg(value: str) -> list[str]:
    """The ``--allowed-origins`` argparse type."""
    try:
        return parse_allowed_origins(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


class RequestIdMiddleware:
    """Every response carries ``x-request-id``: the client's own (if sane) or a fresh one. Pure
    ASGI, so streaming responses and disconnects pass through untouched."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = next((v for k, v in scope["headers"] if k == b"x-request-id"), b"")
        if not (0 < len(rid) <= 256 and all(0x21 <= b <= 0x7E for b in rid)):
            rid = uuid.uuid4().hex.encode()
        scope.setdefault("state", {})["request_id"] = rid.decode()

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", rid)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


def create_app(engine: EngineClient, model_name: str, api_keys: list[str] | None = None,
               max_waiting: int = 256, warmup: bool = True, allowed_origins: list[str] | None = None,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
               shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S, admin_key: str | None = None) -> FastAPI:
    """Serve ``engine`` (the app's lifespan starts and shuts it down). ``admin_key``: the bearer
    key of the ``/admin/engines`` routes (``kvos.serve.admin``; off without one). ``allowed_origins``: turn
    CORS on for these origins (``["*"]``: any); off when None or empty. ``max_request_bytes``:
    larger bodies get 413. ``shutdown_timeout_s``: how long shutdown waits for requests in flight
    before cutting them (``app.state.kvos.drain``)."""
    state = ServerState(engine, model_name, api_keys or [], max_waiting, shutdown_timeout_s)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        state.engine.start()
        task = asyncio.create_task(_warm_up(state) if warmup else _mark_ready(state))
        yield
        await state.drain()  # at once when the server's signal handler already drained
        task.cancel()
        state.engine.shutdown()
        if state.tokenizers is not None:
            state.tokenizers.shutdown()

    app = FastAPI(title="kvos", version=kvos.__version__, lifespan=lifespan)
    app.state.kvos = state
    add_admin_routes(app, engine, admin_key)
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_request_bytes)  # inside CORS: a 413 is readable
    if allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=allowed_origins, allow_methods=["*"], allow_headers=["*"],
                           expose_headers=["x-request-id"], max_age=600)
    app.add_middleware(RequestIdMiddleware)  # outermost: CORS preflights get an id too

    @app.exception_handler(EngineStopped)
    async def _stopped(_: Request, e: EngineStopped):
        return error_response(503, str(e), "service_unavailable", code=e.code)

    @app.exception_handler(RequestFailed)
    async def _failed(_: Request, e: RequestFailed):
        return error_response(500, str(e), "internal_error", code=e.code)

    @app.exception_handler(ClientDisconnected)
    async def _gone(_: Request, __: ClientDisconnected):
        return Response(status_code=499)  # nobody reads it

    @app.get("/health")
    async def health():
        engines = state.engine.health()
        if state.ready and not state.draining and engines.serving:
            return {"status": "degraded" if engines.degraded else "ok", **engines.json()}
        status = "draining" if state.draining else "warming_up" if not state.ready else "no_engine"
        return JSONResponse({"status": status, **engines.json()}, status_code=503)

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version():
        return {"version": kvos.__version__}

    auth = [Depends(_auth(state))]

    @app.post("/tokenize", dependencies=auth)
    async def tokenize(body: TokenizeRequest):
        """vLLM's ``/tokenize``: the ids a prompt (or a chat) becomes, and the context length.
        Bounded as generation is: text that cannot fit the context by its size alone is a 400
        before any tokenizing, and work being tokenized counts against ``--max-waiting-requests``."""
        param = "messages" if body.messages is not None else "prompt"
        admit(state, body.model, 1, param)
        state.require_tokenizer(param)
        if body.messages is not None:
            messages = _messages(body.messages)
            state.check_fits(user_text(messages), "messages")
            with state.tokenizing(1):
                ids = await state.tokenizers.run(lambda tok: _chat_ids(tok, messages, body.add_generation_prompt,
                                                                       bool(body.add_special_tokens)))
        else:
            special = body.add_special_tokens is not False
            state.check_fits(body.prompt, "prompt")
            try:
                with state.tokenizing(1):
                    ids = await state.tokenizers.run(lambda tok: list(tok(body.prompt, add_special_tokens=special)
                                                                      .input_ids))
            except Exception as e:  # e.g. lone surrogates
                raise APIError(400, f"prompt cannot be tokenized ({type(e).__name__})", param="prompt") from e
        # a long prompt's answer is large: build it on the worker too, not on the event loop
        content = await state.tokenizers.run(lambda tok: _tokenize_json(
            ids, state.max_model_len, tok.convert_ids_to_tokens(ids) if body.return_token_strs else None))
        return Response(content, media_type="application/json")

    @app.post("/detokenize", dependencies=auth)
    async def detokenize(body: DetokenizeRequest):
        check_model(state, body.model)
        state.require_tokenizer("tokens")
        vocab = state.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"tokens: every id must be in [0, {vocab}), got {bad}", param="tokens")
        try:
            text = state.tokenizer.decode(body.tokens)
        except Exception as e:  # an id the model has but the tokenizer lacks (padding rows)
            raise APIError(400, f"tokens cannot be decoded ({type(e).__name__})", param="tokens") from e
        return {"prompt": text}

    v1 = APIRouter(prefix="/v1", dependencies=auth)

    @v1.post("/cache/pins")
    async def pin_prefix(body: PinRequest, request: Request):
        """Pin a prefix (e.g. a system prompt) for the caller's tenant: its full blocks are
        never evicted until ``DELETE /v1/cache/pins/{pin_id}`` or ``ttl_s`` seconds."""
        check_model(state, body.model)
        if body.messages is not None:
            state.require_tokenizer("messages")
            messages = _messages(body.messages)
            state.check_fits(user_text(messages), "messages")
            prompt = {"prompt_token_ids": await state.tokenizers.run(lambda tok: _chat_ids(tok, messages, False,
                                                                                           False))}
        elif isinstance(body.prompt, list):
            prompt = {"prompt_token_ids": body.prompt}
        else:
            prompt = (await _pretokenize(state, [body.prompt]))[0]
        # a ValueError is a 400 naming the field
        pin = await state.engine.pin(prompt, body.ttl_s, request_salt(request, body.cache_salt))
        state.pin_tenants[pin.pin_id] = getattr(request.state, "tenant", None)
        return {"object": "cache.pin", **_pin_json(pin)}

    @v1.get("/cache/pins")
    async def list_pins(request: Request):
        mine = _tenant_pins(state, request)
        pins = await state.engine.list_pins(mine)
        return {"object": "list", "data": [{"object": "cache.pin", **_pin_json(p)} for p in pins]}

    @v1.delete("/cache/pins/{pin_id}")
    async def unpin_prefix(pin_id: str, request: Request):
        if pin_id not in _tenant_pins(state, request) or not await state.engine.unpin(pin_id):
            raise APIError(404, f"pin_id: no pin {clip(pin_id)!r}", param="pin_id", code="pin_not_found")
        state.pin_tenants.pop(pin_id, None)
        return {"object": "cache.pin.deleted", "id": pin_id, "deleted": True}

    @v1.get("/models")
    async def models():
        return {"object": "list", "data": [state.model_card()]}

    @v1.get("/models/{model_id:path}")
    async def model(model_id: str):
        check_model(state, model_id)
        return state.model_card()

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request):
        num_seqs = len(body.prompts()) * body.n
        admit(state, body.model, num_seqs, "n" if body.n > 1 else "prompt")
        if body.echo:
            state.require_tokenizer("echo")
        with state.tokenizing(num_seqs):
            prompts = await _pretokenize(state, body.prompts(), body.truncate_prompt_tokens)
        for p in prompts:
            check_length(state, p, body.max_tokens, "max_tokens")
        params = body.sampling_params(body.max_tokens, body.logprobs, state.default_sampling)
        if body.echo and body.logprobs is not None:  # the echoed prompt's logprobs come first
            params.prompt_logprobs = max(params.prompt_logprobs or 0, body.logprobs)
        rid = f"cmpl-{uuid.uuid4().hex}"
        streams = await submit_all(state, prompts, params, rid, body.priority,
                                   request_salt(request, body.cache_salt), bool(body.stream))
        with_ids = _returns_token_ids(state, body)
        if body.stream:
            return sse_response(completion_chunks(state, rid, streams, params.n, UsageMode(body), body.echo,
                                                  with_ids, body.prompt_logprobs is not None))
        outs = await collect(state, request, streams)
        observe_finished(state, streams)
        return completion_body(rid, state.model_name, outs, params.n, state.logprobs, state.fingerprint,
                               body.echo, with_ids, body.prompt_logprobs is not None)

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        admit(state, body.model, body.n, "n")
        state.require_tokenizer("messages")
        messages = _messages(body.messages)
        tools = ChatTools.of(body, state.tokenizer, state.tool_call_parser)
        messages, template_tools = tools.prompt(messages)
        if body.truncate_prompt_tokens is None:  # else a long chat may still fit once cut
            state.check_fits(user_text(messages), "messages")
        messages, images = split_image_parts(messages)
        media = state.require_media(images)
        template = {"add_generation_prompt": body.add_generation_prompt,
                    "continue_final_message": body.continue_final_message,
                    "template_kwargs": body.chat_template_kwargs}
        with state.tokenizing(body.n):
            if images:  # decoded and preprocessed on a worker thread, each error naming its part
                prepared = await state.tokenizers.run(lambda tok: [media.prepare(src, where) for where, src in images])
                ids = await state.tokenizers.run(lambda tok: chat_prompt_ids(
                    tok, messages, tools=template_tools,
                    expand=lambda text: expand_image_text(text, tok, media.vision, prepared), **template))
                spans = ()
            else:
                ids, spans = await state.tokenizers.run(lambda tok: chat_ids_and_spans(
                    tok, messages, template_tools, state.segment_reuse, template))
        k = body.truncate_prompt_tokens
        if k is not None and len(ids) > k:
            if images:
                raise APIError(400, "truncate_prompt_tokens: a prompt with images cannot be cut",
                               param="truncate_prompt_tokens")
            ids, spans = truncate_prompt(ids, spans, k)
        check_length(state, {"prompt_token_ids": ids}, body.effective_max_tokens(),
                      "max_completion_tokens" if body.max_completion_tokens else "max_tokens", "messages")
        top_n = body.top_logprobs or 0
        params = body.sampling_params(body.effective_max_tokens(), body.effective_logprobs(), state.default_sampling)
        if tools.forced:
            if params.structured_outputs is not None:
                raise APIError(400, f"tool_choice: a forced tool call cannot also follow "
                                    f"{params.structured_outputs.field_name}", param="tool_choice")
            params.structured_outputs = tools.grammar()
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        prompt = {"prompt_token_ids": ids, "segment_spans": spans}
        if images:
            prompt["multi_modal_data"] = {"image": prepared}
        streams = await submit_all(state, [prompt], params, rid, body.priority,
                                   request_salt(request, body.cache_salt), bool(body.stream))
        with_ids = _returns_token_ids(state, body)
        if body.stream:
            return sse_response(chat_chunks(state, rid, streams[0], UsageMode(body), top_n, with_ids, tools))
        outs = await collect(state, request, streams)
        observe_finished(state, streams)
        return chat_body(rid, state.model_name, outs[0], state.logprobs, top_n, state.fingerprint, with_ids, tools)

    app.include_router(v1)
    app.include_router(kv_summary_router(state, auth))  # GET /v1/kv/summary (kvos top)
    app.include_router(responses_router(state, auth))  # /v1/responses (OpenAI's Responses API)

    @app.post("/invocations", dependencies=auth)
    async def invocations(request: Request):
        """SageMaker's (and vLLM's) single endpoint: a body with ``messages`` is a chat
        completion, one with ``prompt`` a completion; the same validation, errors and answers."""
        raw = await request.body()
        try:
            data = json.loads(raw)
        except ValueError:
            raise APIError(400, "invalid JSON body", code="invalid_json") from None
        kind = (ChatCompletionRequest if isinstance(data, dict) and "messages" in data
                else CompletionRequest if isinstance(data, dict) and "prompt" in data else None)
        if kind is None:
            raise APIError(400, "messages: /invocations needs 'messages' (a chat completion) or 'prompt' "
                                "(a completion)", param="messages")
        try:
            body = kind.model_validate_json(raw)
        except ValidationError as e:
            raise RequestValidationError(e.errors()) from None
        handler = chat_completions if kind is ChatCompletionRequest else completions
        return await handler(body, request)

    return app


# -- helpers ------------------------------------------------------------------------------
async def _mark_ready(state: ServerState) -> None:
    state.ready = True


async def _warm_up(state: ServerState) -> None:
    """Run a few requests through the whole pipeline (tokenizer, scheduler, model, sampler,
    detokenizer) before reporting ready."""
    t0 = time.perf_counter()
    try:
        params = SamplingParams(temperature=0, max_tokens=4)
        prompts = list(WARMUP_PROMPTS) if state.tokenizer is not None else [{"prompt_token_ids": list(range(1, 9))}]
        if has_chat_template(state.tokenizer):  # a base model has none
            prompts.append({"prompt_token_ids": chat_prompt_ids(state.tokenizer, [{"role": "user", "content": "Hi"}])})
        streams = [await state.engine.submit(p, params, f"warmup-{i}", cache_salt="kvos-warmup")
                   for i, p in enumerate(prompts)]
        sampled = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=2, seed=0)  # the top-p kernel compiles here
        streams.append(await state.engine.submit(prompts[0], sampled, "warmup-sampled", cache_salt="kvos-warmup"))
        await asyncio.gather(*(s.result() for s in streams))
        state.ready = True
        log.info("warm-up done in %.1f s; ready", time.perf_counter() - t0)
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


def _tenant_pins(state: ServerState, request: Request) -> set[str]:
    tenant = getattr(request.state, "tenant", None)
    return {pin_id for pin_id, t in state.pin_tenants.items() if t == tenant}


def _pin_json(pin: PinInfo) -> dict:
    return {"id": pin.pin_id, "pinned_tokens": pin.num_tokens, "pinned_blocks": pin.num_blocks,
            "expires_in_s": pin.expires_in_s}


def _returns_token_ids(state: ServerState, body) -> bool:
    """vLLM's ``return_token_ids``: each choice carries its ``token_ids`` (a stream: each chunk its
    new ones) and its ``prompt_token_ids`` (a stream: in its first chunk). On by default without a
    tokenizer, where the text is always empty."""
    return body.return_token_ids if body.return_token_ids is not None else state.tokenizer is None


def _messages(messages) -> list[dict]:
    """The messages as the chat template takes them (a ``name`` is passed on; most templates
    ignore it). Text that is not valid Unicode (a lone UTF-16 surrogate, which JSON can carry) is
    a 400 naming the message's field, before any tokenizer sees it."""
    out = []
    for i, m in enumerate(messages):
        msg = {"role": m.role, "content": m.parts() or m.text(), **({"name": m.name} if m.name is not None else {})}
        if m.tool_calls:
            msg["tool_calls"] = [c.model_dump() for c in m.tool_calls]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        for key in ("content", "name"):
            if isinstance(msg.get(key), str):
                try:
                    msg[key].encode("utf-8")
                except UnicodeEncodeError:
                    raise APIError(400, f"messages.{i}.{key} is not valid Unicode (it holds a lone UTF-16 "
                                        f"surrogate)", param=f"messages.{i}.{key}") from None
        out.append(msg)
    return out


def _chat_ids(tokenizer, messages: list[dict], add_generation_prompt: bool, add_special_tokens: bool) -> list[int]:
    """The chat's prompt ids (``chat_prompt_ids``: special-token text in messages stays text);
    ``add_special_tokens`` adds the tokenizer's BOS/EOS around them."""
    return chat_prompt_ids(tokenizer, messages, add_generation_prompt, add_special_tokens)


def _tokenize_json(ids: list[int], max_model_len: int, token_strs: list[str] | None) -> bytes:
    """``/tokenize``'s body. Serialized in slices so that a worker thread doing it lets the others
    (event loop, engine) take the GIL in between."""
    def array(items: list) -> str:
        step = 16384
        return "[" + ",".join(json.dumps(items[i:i + step])[1:-1] for i in range(0, len(items), step)) + "]"

    strs = "" if token_strs is None else f', "token_strs": {array(token_strs)}'
    return f'{{"count": {len(ids)}, "max_model_len": {max_model_len}, "tokens": {array(ids)}{strs}}}'.encode()


async def _segmented(state: ServerState, prompt: dict, check_fits: bool = True) -> dict:
    """A prompt given as segment parts, tokenized on a worker thread (``encode_segments``): its
    ids and each part's span; 400 naming ``prompt`` for a bad part."""
    segments = prompt["segments"]
    if any(isinstance(s, str) for s in segments):
        state.require_tokenizer("prompt")
        for s in segments:
            if isinstance(s, str) and check_fits:
                state.check_fits(s, "prompt")
    try:
        if state.tokenizers is None:
            text, ids, spans = encode_segments(None, segments, state.vocab_size)
        else:
            text, ids, spans = await state.tokenizers.run(lambda tok: encode_segments(tok, segments, state.vocab_size))
    except ValueError as e:
        raise APIError(400, f"prompt: {e}", param="prompt") from None
    return {"prompt": text, "prompt_token_ids": ids, "segment_spans": spans}


def _truncated(prompt, k: int | None):
    """``truncate_prompt_tokens``: a tokenized prompt (dict) cut to its last ``k`` ids, without
    its text once cut (echo decodes the ids the model saw); anything else as it is."""
    if k is None or not isinstance(prompt, dict) or len(prompt.get("prompt_token_ids") or ()) <= k:
        return prompt
    ids, spans = truncate_prompt(prompt["prompt_token_ids"], tuple(prompt.get("segment_spans") or ()), k)
    return {**prompt, "prompt": None, "prompt_token_ids": ids, "segment_spans": spans}


async def _pretokenize(state: ServerState, prompts: list, truncate: int | None = None) -> list:
    """Tokenize text prompts on a worker thread, as the engine would, so the engine thread never
    does; a prompt whose size alone proves it cannot fit the context is refused first (400 naming
    ``prompt``, nothing tokenized), as is one that tokenizes past it. A prompt that fails to
    tokenize, or becomes no tokens, is passed on as text: the engine's error names what is wrong
    with it. ``truncate`` (``truncate_prompt_tokens``) cuts every prompt to its last ids first,
    so no prompt is too long for its size alone."""
    prompts = [await _segmented(state, p, truncate is None) if isinstance(p, dict) and "segments" in p else p
               for p in prompts]
    texts = [p for p in prompts if isinstance(p, str) and p]
    if texts:
        state.require_tokenizer("prompt")
    for p in texts if truncate is None else ():
        state.check_fits(p, "prompt")

    def encode(tok) -> list[list[int]]:
        out = []
        for p in texts:
            try:
                out.append(list(tok(p).input_ids))
            except Exception:
                out.append([])
        return out

    encoded = iter(await state.tokenizers.run(encode) if texts else [])
    out = []
    for p in prompts:
        if isinstance(p, str) and p:
            ids = next(encoded)
            if ids:
                p = _truncated({"prompt": p, "prompt_token_ids": ids}, truncate)
                ids = p["prompt_token_ids"]
            if len(ids) >= state.max_model_len:
                raise APIError(400, f"prompt is {len(ids)} tokens; max_model_len is {state.max_model_len}, which "
                                    f"leaves no room for output", param="prompt", code="context_length_exceeded")
        out.append(_truncated(p, truncate))
    return out

