"""The steps every generation route shares (``/v1/completions``, ``/v1/chat/completions``,
``/v1/responses``): admission and backpressure, the tenant's cache salt, a chat's prompt ids, the
context-length check, submitting to the engine and waiting for the outputs."""
from __future__ import annotations

import asyncio
import logging

from fastapi import Request

from kvos.core.sampling_params import SamplingParams
from kvos.engine.chat import chat_prompt_ids, message_spans
from kvos.engine.client import RequestFailed, RequestStream
from kvos.serve.errors import APIError, clip
from kvos.serve.state import ServerState
from kvos.serve.streaming import observe_finished

log = logging.getLogger("kvos.serve")


class ClientDisconnected(Exception):
    """The client of a non-streaming request went away; its requests were aborted."""


def request_salt(request: Request, cache_salt: str | None) -> str | None:
    """Tenant isolation: the API key's tenant (when keys are configured) and the body's
    ``cache_salt`` both go into the root of every block hash."""
    tenant = getattr(request.state, "tenant", None)
    if tenant is None:
        return cache_salt
    return f"{tenant}:{cache_salt or ''}"


def check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise APIError(404, f"The model `{clip(model)}` does not exist (this server serves `{state.model_name}`)",
                       param="model", code="model_not_found")


def admit(state: ServerState, model: str | None, num_seqs: int, param: str) -> None:
    """Backpressure in sequences (prompts × ``n``), not requests: past ``max_waiting`` sequences
    waiting for their first token, 429; a request that alone is larger, 400 naming ``param``."""
    if state.draining:
        raise APIError(503, "server is shutting down", "service_unavailable", code="draining")
    check_model(state, model)
    if num_seqs > state.max_waiting:
        raise APIError(400, f"{param}: this request makes {num_seqs} sequences (prompts × n), more than the "
                       f"server queues at once ({state.max_waiting}, --max-waiting-requests)", param=param)
    if state.engine.num_pending + state.num_tokenizing + num_seqs > state.max_waiting:
        state.metrics.rejected.labels("429").inc()
        raise APIError(429, f"too many waiting requests ({state.max_waiting}); retry later",
                       "rate_limit_error", code="queue_full", headers={"Retry-After": "1"})


def chat_ids_and_spans(tokenizer, messages: list[dict], tools, segments: bool, template: dict):
    """The chat's prompt ids (``template``: ``chat_prompt_ids``'s template options) and, when the
    engines reuse segments, each message's span."""
    ids = chat_prompt_ids(tokenizer, messages, tools=tools, **template)
    return ids, message_spans(tokenizer, messages, ids, tools) if segments else ()


def user_text(messages: list[dict]) -> str:
    """The text of the user messages: chat templates render each of them whole, so a chat prompt
    is at least as long (other roles' text may be dropped, e.g. earlier reasoning)."""
    return "".join(m["content"] if isinstance(m.get("content"), str) else
                   "\n".join(p.get("text", "") for p in m["content"] if isinstance(p, dict))
                   for m in messages if m.get("role") == "user" and isinstance(m.get("content"), (str, list)))


def check_length(state: ServerState, prompt, max_tokens: int | None, param: str,
                  prompt_param: str = "prompt") -> None:
    """Prompt plus ``max_tokens`` must fit the context (OpenAI and vLLM refuse, never clamp); a
    prompt alone that leaves no room for output is the prompt's error (``prompt_param``), as
    text, token ids or chat alike. Both are ``context_length_exceeded``."""
    ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else prompt if isinstance(prompt, list) else None
    if ids is None:
        return
    n, limit = len(ids), state.max_model_len
    if n >= limit:
        raise APIError(400, f"{prompt_param} is {n} tokens; max_model_len is {limit}, which leaves no room for "
                            f"output", param=prompt_param, code="context_length_exceeded")
    if max_tokens is not None and limit < n + max_tokens:
        raise APIError(400, f"{param} is too large: the prompt is {n} tokens and {param} is {max_tokens}, "
                            f"{n + max_tokens} in all, past this model's maximum context length of {limit} "
                            f"tokens; ask for at most {limit - n}", param=param, code="context_length_exceeded")


async def submit_all(state: ServerState, prompts: list, params: SamplingParams, rid: str, priority: int,
                      salt: str | None, stream: bool) -> list[RequestStream]:
    """``stream``: the client sees tokens as they come, so after the first one the request can
    no longer restart elsewhere (a data-parallel front end retries only what it may)."""
    streams: list[RequestStream] = []
    try:
        for i, prompt in enumerate(prompts):
            streams.append(await state.engine.submit(prompt, params, f"{rid}-{i}", priority, salt,
                                                     retriable=not stream))
    except BaseException:
        for s in streams:
            await s.aclose()
        raise
    return streams


async def collect(state: ServerState, request: Request, streams: list[RequestStream]):
    """Wait for every stream; abort them all if the client goes away first (one log line, no
    traceback: ``ClientDisconnected`` becomes a response nobody reads)."""
    work = asyncio.ensure_future(asyncio.gather(*(s.result() for s in streams)))
    work.add_done_callback(_retrieve)
    try:
        while True:
            done, _ = await asyncio.wait({work}, timeout=0.5)
            if done:
                try:
                    return work.result()
                except RequestFailed:  # counted as "error" in the metrics, then a 500
                    observe_finished(state, streams)
                    raise
            if await request.is_disconnected():
                break
    finally:
        if not work.done():
            work.cancel()
            for s in streams:
                await s.aclose()
    observe_finished(state, streams)
    log.info("client disconnected; aborted %s (x-request-id %s)", streams[0].request_id.rsplit("-", 1)[0],
             request.scope.get("state", {}).get("request_id"))
    raise ClientDisconnected


def _retrieve(fut: asyncio.Future) -> None:
    """Mark a cancelled gather's outcome as seen (else asyncio logs "exception was never retrieved")."""
    if not fut.cancelled():
        fut.exception()
