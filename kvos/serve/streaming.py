"""The SSE side of the OpenAI server: completion and chat chunks from request streams, the usage
modes of ``stream_options``, and the error event that ends a stream cut short.

Contract: every stream these generators produce ends with ``data: [DONE]``, also after an error
(an error event first); a generator records its requests in the server's metrics when it ends
(finished, failed or closed)."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse

from kvos.engine.client import EngineStopped, RequestFailed, RequestStream
from kvos.serve.responses import finish_reason, prompt_text, sse, usage
from kvos.serve.state import ServerState
from kvos.structured.tool_calls import ToolCallStream

log = logging.getLogger("kvos.serve")


def observe_finished(state: ServerState, streams: list[RequestStream]) -> None:
    """Record each stream's request in the server's metrics as it stands (its last output)."""
    now = time.monotonic()
    for s in streams:
        out = s.last
        if out is None:
            continue
        c = out.outputs[0]
        state.metrics.observe(len(out.prompt_token_ids), s.arrival, s.first_output_time, now,
                              len(c.token_ids), "error" if c.failed else finish_reason(c) or "abort")


def sse_response(gen: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(gen, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, object]]:
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
        except Exception as e:  # the consumer raises it
            await queue.put((i, e))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    live = len(tasks)
    try:
        while live:
            i, out = await queue.get()
            if out is None:
                live -= 1
            elif isinstance(out, Exception):
                raise out
            else:
                yield i, out
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            await s.aclose()


def error_event(e: Exception) -> dict:
    """The SSE event that ends a stream cut short (OpenAI's error shape): 503 ``draining`` when the
    server shut down, else an internal error."""
    if isinstance(e, EngineStopped):
        return {"error": {"message": str(e), "type": "service_unavailable", "param": None, "code": e.code}}
    if isinstance(e, RequestFailed):  # the engine logged it where it failed
        return {"error": {"message": str(e), "type": "internal_error", "param": None, "code": e.code}}
    log.exception("stream failed")
    return {"error": {"message": f"internal error: {e}", "type": "internal_error", "param": None, "code": None}}


class UsageMode:
    """``stream_options``: ``include_usage`` adds a last chunk with the usage (and ``"usage": null``
    on every other chunk, as OpenAI sends); ``continuous_usage_stats`` (vLLM) puts the usage so far
    in every chunk."""

    def __init__(self, body) -> None:
        opts = body.stream_options
        self.final = bool(opts and opts.include_usage)
        self.continuous = bool(opts and opts.continuous_usage_stats)

    def field(self, outs) -> dict:
        if self.continuous:
            return {"usage": usage(outs)}
        return {"usage": None} if self.final else {}


async def completion_chunks(state: ServerState, rid: str, streams: list[RequestStream], n: int,
                             mode: UsageMode, echo: bool = False, token_ids: bool = False,
                             prompt_logprobs: bool = True) -> AsyncIterator[str]:
    """With ``echo`` a choice's first chunk starts with the prompt's text (and, with
    ``logprobs``, its tokens' logprobs first); with ``prompt_logprobs`` it carries vLLM's prompt
    logprobs. With ``token_ids`` every new token makes a chunk (text or not)."""
    created, model = int(time.time()), state.model_name
    base = {"id": rid, "object": "text_completion", "created": created, "model": model,
            "system_fingerprint": state.fingerprint}
    sent_text: dict[tuple[int, int], int] = {}
    sent_tokens: dict[tuple[int, int], int] = {}
    finished: set[tuple[int, int]] = set()
    last = {}
    try:
        async for i, out in merge_streams(streams):
            last[i] = out
            for c in out.outputs:
                key = (i, c.index)
                if key in finished:
                    continue
                first = key not in sent_text
                t0, k0 = sent_text.get(key, 0), sent_tokens.get(key, 0)
                delta = c.text[t0:]
                reason = finish_reason(c)
                new_ids = token_ids and len(c.token_ids) > k0
                if not delta and not new_ids and reason is None and not (first and (echo or out.prompt_logprobs)):
                    continue
                sent_text[key], sent_tokens[key] = len(c.text), len(c.token_ids)
                head = prompt_text(out, state.tokenizer) if echo else ""
                if first and echo:
                    delta = head + delta
                logprobs = state.logprobs.completion(c, k0, len(head) + t0)
                if first and echo:
                    logprobs = state.logprobs.echoed(out.prompt_token_ids, out.prompt_logprobs, logprobs)
                choice = {"index": i * n + c.index, "text": delta, "logprobs": logprobs, "finish_reason": reason,
                          "stop_reason": c.stop_reason if reason is not None else None}
                if first and out.prompt_logprobs is not None and prompt_logprobs:
                    choice["prompt_logprobs"] = state.logprobs.prompt(out.prompt_logprobs)
                if token_ids:
                    choice["token_ids"] = c.token_ids[k0:]
                    if first:
                        choice["prompt_token_ids"] = out.prompt_token_ids
                if reason is not None:
                    finished.add(key)
                yield sse({**base, "choices": [choice], **mode.field([last[i] for i in sorted(last)])})
        if mode.final:
            yield sse({**base, "choices": [], "usage": usage([last[i] for i in sorted(last)])})
        yield sse("[DONE]")
    except Exception as e:  # cut at shutdown, or an engine error: say so and end the stream properly
        yield sse(error_event(e))
        yield sse("[DONE]")
    finally:
        observe_finished(state, streams)


async def chat_chunks(state: ServerState, rid: str, stream: RequestStream, mode: UsageMode,
                       top_n: int, token_ids: bool = False, tools=None) -> AsyncIterator[str]:
    """With active tools (``ChatTools``) calls are sent as OpenAI streams them: per call, a
    ``tool_calls`` delta with its index, id, type and name (arguments ``""``), then one with its
    arguments; text that may still open a call is held back; the finish reason is ``tool_calls``."""
    if tools is not None and not tools.active:
        tools = None
    splitters: dict[int, ToolCallStream] = {}
    created, model = int(time.time()), state.model_name
    base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "system_fingerprint": state.fingerprint}
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
                    first = {"index": c.index, "delta": {"role": "assistant", "content": ""},
                             "logprobs": None, "finish_reason": None}
                    if token_ids:
                        first["prompt_token_ids"] = out.prompt_token_ids
                    yield sse({**base, "choices": [first], **mode.field([out])})
                t0, k0 = sent_text[c.index], sent_tokens[c.index]
                delta, reason = c.text[t0:], finish_reason(c)
                calls = []
                if tools is not None:
                    split = splitters.setdefault(c.index, ToolCallStream(tools.parser, tools.forced))
                    delta, calls = split.feed(c.text, reason is not None)
                    if split.calls and reason == "stop":
                        reason = "tool_calls"
                if delta or (len(c.token_ids) > k0 and (tools is None or token_ids)):
                    sent_text[c.index], sent_tokens[c.index] = len(c.text), len(c.token_ids)
                    choice = {"index": c.index, "delta": {"content": delta},
                              "logprobs": state.logprobs.chat(c, k0, top_n), "finish_reason": None}
                    if token_ids:
                        choice["token_ids"] = c.token_ids[k0:]
                    yield sse({**base, "choices": [choice], **mode.field([out])})
                for call in calls:
                    n = splitters[c.index].calls.index(call)
                    head = {**call.as_openai(n), "function": {"name": call.name, "arguments": ""}}
                    for d in (head, {"index": n, "function": {"arguments": call.arguments}}):
                        yield sse({**base, "choices": [{"index": c.index, "delta": {"tool_calls": [d]},
                                                        "logprobs": None, "finish_reason": None}],
                                   **mode.field([out])})
                if reason is not None:
                    finished.add(c.index)
                    yield sse({**base, "choices": [{"index": c.index, "delta": {}, "logprobs": None,
                                                    "finish_reason": reason, "stop_reason": c.stop_reason}],
                               **mode.field([out])})
        if mode.final and stream.last is not None:
            yield sse({**base, "choices": [], "usage": usage([stream.last])})
        yield sse("[DONE]")
    except Exception as e:  # cut at shutdown, or an engine error: say so and end the stream properly
        yield sse(error_event(e))
        yield sse("[DONE]")
    finally:
        observe_finished(state, [stream])
