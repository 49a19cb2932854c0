"""The Responses API's answers: output items and the response object from an engine output, and
the server-sent events of a streamed response, as the openai client's stream reader checks them.

Contract: a streamed response's items (ids, order, text, calls) are the ones its final
``response.completed`` (or ``.incomplete``, ``.failed``) event carries; every event has its
``type`` and a ``sequence_number`` counting from 0; a stream cut short (the engine failed, the
server shut down) ends with an ``error`` event. The request's metrics are recorded when the
stream ends, however it ends."""
from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from kvos.core.outputs import RequestOutput
from kvos.serve.chat_tools import ChatTools
from kvos.serve.responses import finish_reason
from kvos.serve.responses_protocol import ResponsesRequest, new_id
from kvos.serve.state import ServerState
from kvos.serve.streaming import error_event, observe_finished
from kvos.structured.tool_calls import ToolCall, ToolCallStream


def message_item(text: str, status: str) -> dict:
    return {"id": new_id("msg"), "type": "message", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def call_item(call: ToolCall, status: str = "completed") -> dict:
    return {"id": new_id("fc"), "type": "function_call", "call_id": call.id, "name": call.name,
            "arguments": call.arguments, "status": status}


def output_items(text: str, reason: str | None, tools: ChatTools) -> list[dict]:
    """A reply as items: its text as one message (unless the reply is only calls), then each
    call found in it (with active tools)."""
    content, calls = tools.parse(text)
    items = [message_item(content or "", "incomplete" if reason == "length" else "completed")] \
        if content or not calls else []
    return items + [call_item(c) for c in calls]


def usage(out: RequestOutput) -> dict:
    n_in, n_out = len(out.prompt_token_ids), len(out.outputs[0].token_ids)
    # cache_write_tokens (OpenAI's, for caches written at a price) is 0: caching here costs nothing
    return {"input_tokens": n_in, "input_tokens_details": {"cached_tokens": out.num_cached_tokens,
                                                           "cache_write_tokens": 0},
            "output_tokens": n_out, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": n_in + n_out}


def echo(body: ResponsesRequest) -> dict:
    """What a response object repeats of its request."""
    fmt = body.text.format if body.text is not None else None
    tools = [{"type": "function", "name": t.get("name"), "description": t.get("description"),
              "parameters": t.get("parameters"), "strict": t.get("strict")} for t in body.tools or ()]
    return {"instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": body.reasoning.model_dump() if body.reasoning is not None else None,
            "store": body.store is not False,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
            "tools": tools, "truncation": "disabled", "user": body.user, "metadata": body.metadata or {},
            "background": False}


@dataclass
class ResponseDraft:
    """One response in the making: its id, creation time, what it echoes of its request, the
    sampling it used (``temperature``, ``top_p``) and its tools."""

    id: str
    body: ResponsesRequest
    model: str
    temperature: float
    top_p: float
    tools: ChatTools
    created_at: int = field(default_factory=lambda: int(time.time()))

    def json(self, status: str, output: list[dict], out: RequestOutput | None = None) -> dict:
        """The response object; ``out`` (the finished engine output) gives its usage and, for a
        sequence the engine cut (``abort``: its output constraint failed), the error."""
        error = None
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        if status == "failed" and out is not None:
            error = {"code": "server_error", "message": str(out.outputs[0].stop_reason)}
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "error": error, "incomplete_details": incomplete, "model": self.model, "output": output,
                "temperature": self.temperature, "top_p": self.top_p, **echo(self.body),
                "usage": usage(out) if out is not None else None}

    def finish(self, out: RequestOutput, items: list[dict]) -> dict:
        reason = finish_reason(out.outputs[0])
        status = {"length": "incomplete", "abort": "failed"}.get(reason or "", "completed")
        return self.json(status, items, out)


def sse_event(kind: str, seq: int, **fields) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq, **fields})}\n\n"


async def response_events(state: ServerState, stream, draft: ResponseDraft,
                          keep: Callable[[dict], None]) -> AsyncIterator[str]:
    """The events of a streamed response: ``response.created`` and ``.in_progress``; a message
    item (``output_item.added``, ``content_part.added``, ``output_text.delta``...,
    ``output_text.done``, ``content_part.done``, ``output_item.done``) opened at its first text;
    per call found, a ``function_call`` item with its arguments in one delta; then
    ``response.completed`` (``.incomplete`` when cut by ``max_output_tokens``, ``.failed`` when
    the engine cut it) with the whole response, which ``keep`` stores first."""
    tools = draft.tools
    split = ToolCallStream(tools.parser, tools.forced) if tools.active else None
    items: list[dict] = []
    message: dict | None = None
    seq = 0

    def event(kind: str, **fields) -> str:
        nonlocal seq
        seq += 1
        return sse_event(kind, seq - 1, **fields)

    def text_event(kind: str, **fields) -> str:
        return event(kind, item_id=message["id"], output_index=items.index(message), content_index=0, **fields)

    sent = 0
    try:
        start = draft.json("in_progress", [])
        yield event("response.created", response=start)
        yield event("response.in_progress", response=start)
        async for out in stream:
            c = out.outputs[0]
            final = finish_reason(c) is not None
            if split is None:
                delta, calls, sent = c.text[sent:], [], len(c.text)
            else:
                delta, calls = split.feed(c.text, final)
                if final and tools.forced and not split.calls:  # no call came out: the text is the reply
                    delta = c.text
            if delta:
                if message is None:
                    message = {**message_item("", "in_progress"), "content": []}
                    items.append(message)
                    yield event("response.output_item.added", output_index=len(items) - 1, item=message)
                    part = {"type": "output_text", "text": "", "annotations": []}
                    yield text_event("response.content_part.added", part=part)
                    message["content"] = [part]
                message["content"][0]["text"] += delta
                yield text_event("response.output_text.delta", delta=delta, logprobs=[])
            for call in calls:
                item = call_item(call, "in_progress")
                items.append(item)
                i = len(items) - 1
                yield event("response.output_item.added", output_index=i, item={**item, "arguments": ""})
                yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=i,
                            delta=call.arguments)
                yield event("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                            name=call.name, arguments=call.arguments)
                item["status"] = "completed"
                yield event("response.output_item.done", output_index=i, item=item)
        last = stream.last
        reason = finish_reason(last.outputs[0])
        if message is None and not any(x["type"] == "function_call" for x in items):
            message = message_item("", "in_progress")
            items.append(message)
            yield event("response.output_item.added", output_index=len(items) - 1, item={**message, "content": []})
            yield text_event("response.content_part.added", part=message["content"][0])
        if message is not None:
            message["status"] = "incomplete" if reason == "length" else "completed"
            part = message["content"][0]
            yield text_event("response.output_text.done", text=part["text"], logprobs=[])
            yield text_event("response.content_part.done", part=part)
            yield event("response.output_item.done", output_index=items.index(message), item=message)
        final = draft.finish(last, items)
        keep(final)
        yield event(f"response.{final['status']}", response=final)
    except Exception as e:  # cut at shutdown, or an engine error: say so, as OpenAI's error event
        err = error_event(e)["error"]
        yield event("error", code=err["code"], message=err["message"], param=None)
    finally:
        observe_finished(state, [stream])
