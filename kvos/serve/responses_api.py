"""OpenAI's Responses API: ``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``.

Built on the chat completions path: the input items become chat messages (``instructions`` a
system message first), rendered by the same chat template with the same tools (``ChatTools``:
shown, forced by a grammar, parsed from the reply), sampling defaults, output constraints
(``text.format``) and limits; errors are 400s naming the Responses field.

Stored responses (``store``, true by default) live in server memory, in an LRU of the last
``STORE_SIZE``; each keeps its conversation (its input, after its ``previous_response_id``'s,
and its output) as chat messages, so a request naming it as ``previous_response_id`` continues
the conversation: its prompt starts with the earlier one's, which the prefix cache holds. A
stored response is seen only by the API-key tenant that made it."""
from __future__ import annotations

import re
import threading
from collections import OrderedDict
from dataclasses import dataclass

from fastapi import APIRouter, Request

from kvos.serve.chat_tools import ChatTools
from kvos.serve.errors import APIError, clip
from kvos.serve.generation import (
    admit,
    chat_ids_and_spans,
    check_length,
    collect,
    request_salt,
    submit_all,
    user_text,
)
from kvos.serve.responses import finish_reason
from kvos.serve.responses_output import ResponseDraft, output_items, response_events
from kvos.serve.responses_protocol import ResponsesRequest, items_to_messages, new_id
from kvos.serve.state import ServerState
from kvos.serve.streaming import observe_finished, sse_response

STORE_SIZE = 4096
"""How many stored responses the server keeps (least recently used dropped first)."""

_RENAMES = ((re.compile(r"^tools\.(\d+)\.function\."), r"tools.\1."),
            (re.compile(r"^tool_choice\.function\."), "tool_choice."),
            (re.compile(r"^text\.format\.json\b"), "text.format.schema"))
"""Chat-API field names in shared code's errors, as the Responses API names them."""


@dataclass
class StoredResponse:
    body: dict
    messages: list[dict]
    """The conversation up to and including this response's output, as chat messages."""
    tenant: str | None


class ResponseStore:
    """The stored responses: an LRU of at most ``capacity``; ``get`` refreshes an entry. Safe from
    any thread."""

    def __init__(self, capacity: int = STORE_SIZE) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, rid: str, entry: StoredResponse) -> None:
        with self._lock:
            self._items[rid] = entry
            self._items.move_to_end(rid)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def get(self, rid: str, tenant: str | None) -> StoredResponse | None:
        """The entry, if stored and made by ``tenant``."""
        with self._lock:
            entry = self._items.get(rid)
            if entry is None or entry.tenant != tenant:
                return None
            self._items.move_to_end(rid)
            return entry

    def delete(self, rid: str, tenant: str | None) -> bool:
        with self._lock:
            entry = self._items.get(rid)
            if entry is None or entry.tenant != tenant:
                return False
            del self._items[rid]
            return True


def renamed(e: ValueError) -> APIError:
    """A shared helper's ValueError (``tools.0.function.name: ...``) as a 400 naming the
    Responses field (``tools.0.name``)."""
    message = str(e)
    for pattern, new in _RENAMES:
        message = pattern.sub(new, message, count=1)
    head = message.split(" ", 1)[0].rstrip(":")
    return APIError(400, message, param=head if re.fullmatch(r"[\w.\[\]]+", head) else None)


def _not_found(rid: str, param: str, code: str) -> APIError:
    return APIError(404, f"{param}: no stored response with id {clip(rid)!r} (stored responses are kept in server "
                         f"memory, the last {STORE_SIZE})", param=param, code=code)


def responses_router(state: ServerState, auth: list, store: ResponseStore | None = None) -> APIRouter:
    store = store if store is not None else ResponseStore()
    router = APIRouter(prefix="/v1", dependencies=auth)

    @router.post("/responses")
    async def create_response(body: ResponsesRequest, request: Request):
        admit(state, body.model, 1, "input")
        state.require_tokenizer("input")
        tenant = getattr(request.state, "tenant", None)
        history: list[dict] = []
        if body.previous_response_id is not None:
            prev = store.get(body.previous_response_id, tenant)
            if prev is None:
                raise _not_found(body.previous_response_id, "previous_response_id", "previous_response_not_found")
            history = prev.messages
        conversation = [*history, *body.input_messages()]
        system = [{"role": "system", "content": body.instructions}] if body.instructions is not None else []
        try:
            tools = ChatTools.make(*body.chat_tools(), body.parallel_tool_calls, state.tokenizer,
                                   state.tool_call_parser)
        except ValueError as e:
            raise renamed(e) from None
        messages, template_tools = tools.prompt([*system, *conversation])
        state.check_fits(user_text(messages), "input")
        template = {"add_generation_prompt": True, "continue_final_message": False, "template_kwargs": None}
        with state.tokenizing(1):
            ids, spans = await state.tokenizers.run(lambda tok: chat_ids_and_spans(
                tok, messages, template_tools, state.segment_reuse, template))
        check_length(state, {"prompt_token_ids": ids}, body.max_output_tokens, "max_output_tokens", "input")
        params = body.sampling_params(state.default_sampling)
        if tools.forced:
            if params.structured_outputs is not None:
                raise APIError(400, "tool_choice: a forced tool call cannot also follow text.format",
                               param="tool_choice")
            params.structured_outputs = tools.grammar()
        rid = new_id("resp")
        try:
            streams = await submit_all(state, [{"prompt_token_ids": ids, "segment_spans": spans}], params, rid,
                                       body.priority, request_salt(request, body.cache_salt), bool(body.stream))
        except ValueError as e:  # the engine's, e.g. a text.format schema that does not compile
            raise renamed(e) from None
        draft = ResponseDraft(rid, body, state.model_name, params.temperature, params.top_p, tools)

        def keep(response: dict) -> None:
            if body.store is not False:
                store.put(rid, StoredResponse(response, [*conversation, *items_to_messages(response["output"])],
                                              tenant))

        if body.stream:
            return sse_response(response_events(state, streams[0], draft, keep))
        out = (await collect(state, request, streams))[0]
        observe_finished(state, streams)
        c = out.outputs[0]
        response = draft.finish(out, output_items(c.text, finish_reason(c), tools))
        keep(response)
        return response

    @router.get("/responses/{response_id}")
    async def get_response(response_id: str, request: Request, stream: bool = False):
        if stream:
            raise APIError(400, "stream: replaying a stored response's events is not supported by this server",
                           param="stream")
        entry = store.get(response_id, getattr(request.state, "tenant", None))
        if entry is None:
            raise _not_found(response_id, "response_id", "not_found")
        return entry.body

    @router.delete("/responses/{response_id}")
    async def delete_response(response_id: str, request: Request):
        if not store.delete(response_id, getattr(request.state, "tenant", None)):
            raise _not_found(response_id, "response_id", "not_found")
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    return router
