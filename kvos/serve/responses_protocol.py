"""The Responses API's request body (``POST /v1/responses``), checked as strictly as the chat
bodies (``kvos.serve.protocol``: no unknown fields, no coercion), and its items as chat messages.

Contract: a field this server would not act on as OpenAI does is a 400 naming it (built-in
tools, ``background``, ``truncation: "auto"``, non-text input parts); ``reasoning``,
``text.verbosity``, ``prompt_cache_key``, ``service_tier`` and ``include:
["reasoning.encrypted_content"]`` change nothing here (no reasoning items are made) and are
accepted. ``items_to_messages`` turns input items and output items alike into the messages of
``/v1/chat/completions``, so a conversation renders the same prompt on both routes."""
from __future__ import annotations

import uuid
from typing import Literal

from pydantic import BaseModel, Field, PrivateAttr, ValidationError, model_validator

from kvos.core.sampling_params import SamplingParams
from kvos.core.structured_outputs import StructuredOutputsParams
from kvos.serve.errors import clip, param_of_loc
from kvos.serve.protocol import STRICT, ModelName, with_model_defaults

Status = Literal["in_progress", "completed", "incomplete"]
IGNORED_INCLUDES = ("reasoning.encrypted_content",)
"""``include`` values that add nothing here: this server makes no reasoning items."""


def new_id(prefix: str) -> str:
    """``resp_...``, ``msg_...``, ``fc_...``."""
    return f"{prefix}_{uuid.uuid4().hex}"


class TextPart(BaseModel):
    """``input_text``, or ``output_text`` as a response returned it (annotations, logprobs)."""

    model_config = STRICT
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list | None = None
    logprobs: list | None = None


class MessageItem(BaseModel):
    model_config = STRICT
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextPart]
    id: str | None = None
    status: Status | None = None
    phase: Literal["commentary", "final_answer"] | None = None


class FunctionCallItem(BaseModel):
    model_config = STRICT
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str
    arguments: str
    id: str | None = None
    status: Status | None = None


class FunctionCallOutputItem(BaseModel):
    model_config = STRICT
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[TextPart]
    id: str | None = None
    status: Status | None = None


ITEM_KINDS = {"message": MessageItem, "function_call": FunctionCallItem,
              "function_call_output": FunctionCallOutputItem}


def parse_item(item: object, where: str) -> dict:
    """One input item checked (``where``: its field, ``input.3``), as a plain dict without nulls;
    a ValueError naming the field that is wrong."""
    if not isinstance(item, dict):
        raise ValueError(f"{where}: an item is an object (a message, function_call or function_call_output)")
    kind = item.get("type", "message")
    if kind not in ITEM_KINDS:
        raise ValueError(f"{where}.type: {clip(kind)!r} items are not supported by this server (message, "
                         f"function_call, function_call_output)")
    parts = item.get("content") if kind == "message" else item.get("output")
    for j, part in enumerate(parts if isinstance(parts, list) else ()):
        ptype = part.get("type") if isinstance(part, dict) else None
        if ptype not in ("input_text", "output_text"):
            field = "content" if kind == "message" else "output"
            raise ValueError(f"{where}.{field}.{j}.type: only text parts (input_text, output_text) are supported, "
                             f"not {clip(ptype)!r}")
    try:
        parsed = ITEM_KINDS[kind].model_validate(item)
    except ValidationError as e:
        err = e.errors()[0]
        loc = tuple(err.get("loc", ()))
        if err.get("type") == "extra_forbidden" and loc:
            inner = ".".join(filter(None, (param_of_loc(loc[:-1]), clip(loc[-1]))))
            raise ValueError(f"{where}.{inner}: Unrecognized argument supplied") from None
        inner = param_of_loc(loc)
        raise ValueError(f"{where}{'.' + inner if inner else ''}: {err.get('msg')}") from None
    out = parsed.model_dump(exclude_none=True)
    for key in ("content", "output"):
        text = _text(out.get(key))
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"{where}.{key} is not valid Unicode (it holds a lone UTF-16 surrogate)") from None
    return out


def _text(content) -> str:
    """Text parts joined with newlines (as the chat route joins a message's text parts)."""
    if isinstance(content, list):
        return "\n".join(p["text"] for p in content)
    return content or ""


def items_to_messages(items: list[dict]) -> list[dict]:
    """Checked items (``parse_item``) as chat messages: a message keeps its role and text; each
    ``function_call`` joins the assistant turn right before it (or opens one) as a ``tool_calls``
    entry; a ``function_call_output`` is a ``tool`` message answering its ``call_id``."""
    out: list[dict] = []
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            out.append({"role": item["role"], "content": _text(item["content"])})
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if out and out[-1]["role"] == "assistant":
                out[-1]["tool_calls"] = [*out[-1].get("tool_calls", []), call]
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        else:
            out.append({"role": "tool", "content": _text(item["output"]), "tool_call_id": item["call_id"]})
    return out


class TextFormat(BaseModel):
    model_config = STRICT
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, max_length=64)
    schema_: dict | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = STRICT
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(BaseModel):
    model_config = STRICT
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(BaseModel):
    """``cache_salt`` and ``priority`` are kvos's (and vLLM's) extensions, as on the chat route."""

    model_config = STRICT
    model: ModelName | None = None
    input: str | list
    instructions: str | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    max_output_tokens: int | None = Field(None, ge=1)
    stream: bool | None = None
    store: bool | None = None
    previous_response_id: str | None = Field(None, min_length=1, max_length=256)
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    reasoning: ReasoningConfig | None = None
    background: bool | None = None
    include: list[str] | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=256)
    priority: int = Field(0, ge=-(2**31), le=2**31 - 1)
    _items: list[dict] = PrivateAttr(default_factory=list)

    @model_validator(mode="after")
    def _check(self):
        if self.background:
            raise ValueError("background: background responses are not supported by this server")
        if self.truncation == "auto":
            raise ValueError("truncation: 'auto' is not supported by this server (a prompt past the context is "
                             "a 400); send 'disabled'")
        bad = next((x for x in self.include or () if x not in IGNORED_INCLUDES), None)
        if bad is not None:
            raise ValueError(f"include: {clip(bad)!r} is not supported by this server")
        if self.metadata is not None and (len(self.metadata) > 16 or any(
                len(k) > 64 or len(v) > 512 for k, v in self.metadata.items())):
            raise ValueError("metadata: at most 16 pairs, keys up to 64 and values up to 512 characters")
        for i, t in enumerate(self.tools or ()):
            if not isinstance(t, dict) or t.get("type") != "function":
                kind = t.get("type") if isinstance(t, dict) else None
                raise ValueError(f"tools.{i}.type: only function tools are supported by this server, not "
                                 f"{clip(kind)!r}")
            extra = set(t) - {"type", "name", "description", "parameters", "strict"}
            if extra:
                raise ValueError(f"tools.{i}.{clip(sorted(extra)[0])}: Unrecognized argument supplied")
            if not isinstance(t.get("strict"), (bool, type(None))):
                raise ValueError(f"tools.{i}.strict: must be true, false or null")
        c = self.tool_choice
        if isinstance(c, dict) and (c.get("type") != "function" or set(c) != {"type", "name"}):
            raise ValueError("tool_choice: this server takes 'none', 'auto', 'required' or "
                             "{\"type\": \"function\", \"name\": ...}")
        if self.text is not None and self.text.format is not None:
            fmt = self.text.format
            if fmt.type == "json_schema" and fmt.schema_ is None:
                raise ValueError("text.format.schema: required for type json_schema")
        for key, value in (("instructions", self.instructions), ("input", self.input)):
            if isinstance(value, str):
                try:
                    value.encode("utf-8")
                except UnicodeEncodeError:
                    raise ValueError(f"{key} is not valid Unicode (it holds a lone UTF-16 surrogate)") from None
        if isinstance(self.input, list):
            if not self.input:
                raise ValueError("input: must not be empty")
            self._items = [parse_item(item, f"input.{i}") for i, item in enumerate(self.input)]
        else:
            self._items = [{"type": "message", "role": "user", "content": self.input}]
        return self

    def input_messages(self) -> list[dict]:
        """The input as chat messages (``instructions`` not included: they do not carry over to a
        later response that names this one as its ``previous_response_id``)."""
        return items_to_messages(self._items)

    def chat_tools(self) -> tuple[list[dict] | None, str | dict | None]:
        """``tools`` and ``tool_choice`` in the chat API's shape (``ChatTools`` takes them). No
        tools (``[]`` too) with ``tool_choice: "auto"`` is no tools, as OpenAI reads it."""
        tools = [{"type": "function", "function": {k: v for k, v in t.items()
                                                   if k in ("name", "description", "parameters") and v is not None}}
                 for t in self.tools or ()] or None
        choice = self.tool_choice
        if isinstance(choice, dict):
            choice = {"type": "function", "function": {"name": choice["name"]}}
        elif tools is None and choice == "auto":
            choice = None
        return tools, choice

    def structured(self) -> StructuredOutputsParams | None:
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True, field_name="text.format")
        return StructuredOutputsParams(json=fmt.schema_, field_name="text.format")

    def sampling_params(self, defaults: dict | None = None) -> SamplingParams:
        """As the chat route builds them: ``defaults`` (the model's) fill what is unset."""
        return SamplingParams(**with_model_defaults({"temperature": self.temperature, "top_p": self.top_p}, defaults),
                              max_tokens=self.max_output_tokens, structured_outputs=self.structured())
