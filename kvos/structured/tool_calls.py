"""Tool (function) calling: the OpenAI ``tools``/``tool_choice`` fields checked, the tools shown to
a model whose chat template does not render them, the grammar that forces a call, and the parsers
that pick calls out of a model's text.

Formats (``TOOL_CALL_PARSERS``):

* ``hermes``: each call is ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``
  (Hermes, Qwen 2.5/3, and any model whose template does not render tools: kvos describes the
  tools to it in this format);
* ``llama3_json``: the reply is ``{"name": ..., "parameters": {...}}`` (calls separated by
  ``;``), optionally after ``<|python_tag|>`` (Llama 3.1/3.2's JSON tool calling).

Contract: ``tool_choice`` ``required`` or a named function constrains the reply with a grammar
(``call_grammar``) so that it parses into calls whose arguments validate against the tools'
schemas; ``auto`` leaves the model free and parses what it wrote (text that is not a whole,
valid call stays content). Errors name the field (``tools.0.function.name``, ``tool_choice``).
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

TOOL_CALL_PARSERS = ("hermes", "llama3_json")
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict

    def as_openai(self) -> dict:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str
    """The arguments as a JSON object's text (OpenAI sends them as a string)."""
    id: str = ""

    def as_openai(self, index: int | None = None) -> dict:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def parse_tools(tools) -> list[Tool]:
    """The request's ``tools`` checked: a non-empty list of ``{"type": "function", "function":
    {"name", "description"?, "parameters"?}}`` with distinct names; ``parameters`` must be a
    JSON schema object (absent: no arguments)."""
    if not isinstance(tools, list) or not tools:
        raise ValueError("tools: must be a non-empty list of {\"type\": \"function\", \"function\": {...}}")
    if len(tools) > 128:
        raise ValueError("tools: at most 128 tools")
    out: list[Tool] = []
    for i, t in enumerate(tools):
        where = f"tools.{i}"
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise ValueError(f"{where}: must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}")
        f = t["function"]
        name = f.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(f"{where}.function.name: must be 1-64 letters, digits, '_', '.' or '-', got {name!r}")
        if any(x.name == name for x in out):
            raise ValueError(f"{where}.function.name: {name!r} is given twice")
        desc = f.get("description", "")
        if not isinstance(desc, str):
            raise ValueError(f"{where}.function.description: must be a string")
        params = f.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise ValueError(f"{where}.function.parameters: must be a JSON schema object")
        out.append(Tool(name, desc, params))
    return out


def parse_tool_choice(choice, tools: list[Tool]) -> str:
    """``"none"``, ``"auto"``, ``"required"``, or the name of the one function to call
    (``{"type": "function", "function": {"name": ...}}``). Unset: ``auto`` with tools, else ``none``."""
    if choice is None:
        return "auto" if tools else "none"
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise ValueError(f"tool_choice: must be 'none', 'auto', 'required' or a named function, got {choice!r}")
        if choice != "none" and not tools:
            raise ValueError(f"tool_choice: {choice!r} needs tools")
        return choice
    if (not isinstance(choice, dict) or choice.get("type") != "function"
            or not isinstance(choice.get("function"), dict)):
        raise ValueError("tool_choice: a named choice is {\"type\": \"function\", \"function\": {\"name\": ...}}")
    name = choice["function"].get("name")
    if not any(t.name == name for t in tools):
        raise ValueError(f"tool_choice.function.name: {name!r} is not one of the tools")
    return "function:" + name


def _call_schema(tool: Tool, fmt: str) -> dict:
    key = "parameters" if fmt == "llama3_json" else "arguments"
    return {"type": "object", "properties": {"name": {"const": tool.name}, key: tool.parameters},
            "required": ["name", key], "additionalProperties": False}


def call_grammar(tools: list[Tool], choice: str, parallel: bool, fmt: str) -> str:
    """A Lark grammar (llguidance's, with ``%json`` schemas) for a reply that is only tool calls:
    one call of the named function, or with ``required`` one call (with ``parallel``, one to
    ``len(tools)``) of any tool, each in ``fmt``'s shape. The cap keeps a small model from
    repeating calls until ``max_tokens`` (SmolLM2 wrote nine identical calls in 300 tokens)."""
    chosen = [t for t in tools if choice == "function:" + t.name] if choice.startswith("function:") else tools
    schemas = [_call_schema(t, fmt) for t in chosen]
    body = "%json " + json.dumps(schemas[0] if len(schemas) == 1 else {"anyOf": schemas})
    extra = len(tools) - 1 if parallel and not choice.startswith("function:") else 0
    if fmt == "llama3_json":
        more = ' ("; " call)?' * extra
        return "start: call" + more + "\ncall: " + body + "\n"
    more = ' ("\\n" call)?' * extra
    return ("start: call" + more + "\n"
            'call: "<tool_call>\\n" call_json "\\n</tool_call>"\n'
            "call_json: " + body + "\n")


def tools_system_text(tools: list[Tool]) -> str:
    """How kvos describes the tools to a model whose chat template cannot (``hermes`` format)."""
    lines = "\n".join(json.dumps(t.as_openai(), ensure_ascii=False) for t in tools)
    return ("You can call functions (tools) to answer. Their signatures, one JSON object per line:\n"
            f"<tools>\n{lines}\n</tools>\n"
            "To call one, reply with a JSON object holding its name and its arguments, inside tags:\n"
            "<tool_call>\n{\"name\": \"function name\", \"arguments\": {\"argument\": \"value\"}}\n</tool_call>\n"
            "Put each call in its own tags. A function's result comes back in <tool_response> tags.")


def hermes_history(messages: list[dict]) -> list[dict]:
    """Earlier turns for a template without tool support: an assistant turn's ``tool_calls`` become
    ``<tool_call>`` blocks in its text, and a ``tool`` turn becomes a user turn holding the result
    in ``<tool_response>`` tags."""
    out = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            blocks = [json.dumps({"name": c["function"]["name"], "arguments": _arguments_obj(c["function"])},
                                 ensure_ascii=False) for c in m["tool_calls"]]
            text = "\n".join(f"<tool_call>\n{b}\n</tool_call>" for b in blocks)
            content = m.get("content") or ""
            out.append({"role": "assistant", "content": (content + "\n" if content else "") + text})
        elif m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"})
        else:
            out.append({k: v for k, v in m.items() if k != "tool_calls"})
    return out


def _arguments_obj(function: dict):
    args = function.get("arguments")
    if isinstance(args, str):
        try:
            return json.loads(args)
        except ValueError:
            return args
    return args


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def _as_call(obj, args_key: tuple[str, ...]) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    for key in args_key:
        if key in obj:
            args = obj[key]
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except ValueError:
                    return None
            if not isinstance(args, dict):
                return None
            return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False), new_call_id())
    return None


def parse_tool_calls(text: str, fmt: str) -> tuple[str | None, list[ToolCall]]:
    """(the content left, the calls) found in a finished reply. A block that is not valid JSON
    naming a function stays in the content."""
    if fmt == "hermes":
        calls, kept, pos = [], [], 0
        for m in _HERMES.finditer(text):
            try:
                call = _as_call(json.loads(m.group(1)), ("arguments", "parameters"))
            except ValueError:
                call = None
            if call is None:
                continue
            kept.append(text[pos: m.start()])
            pos = m.end()
            calls.append(call)
        kept.append(text[pos:])
        content = "".join(kept).strip()
        return (content or None) if calls else text, calls
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text, []
    calls = []
    decoder = json.JSONDecoder()
    i = 0
    while i < len(body):
        try:
            obj, end = decoder.raw_decode(body, i)
        except ValueError:
            return text, []
        call = _as_call(obj, ("parameters", "arguments"))
        if call is None:
            return text, []
        calls.append(call)
        i = end
        while i < len(body) and body[i] in " \n\t;":
            i += 1
    return None, calls


def pick_parser(chat_template: str | None, arch: str = "") -> str:
    """The format a model writes calls in: Llama 3's JSON when its template speaks of
    ``<|python_tag|>``/ipython, else Hermes tags (also what kvos teaches a model without
    tool-aware template)."""
    t = chat_template or ""
    if "<tool_call>" in t:
        return "hermes"
    if "python_tag" in t or "ipython" in t:
        return "llama3_json"
    return "hermes"


class ToolCallStream:
    """Splits a streamed reply into content deltas and whole calls as they complete (``hermes``:
    text that could still become ``<tool_call>`` is held back; ``llama3_json`` and forced calls:
    everything is held to the end). ``feed`` takes the reply's whole text so far."""

    OPEN = "<tool_call>"

    def __init__(self, fmt: str, forced: bool) -> None:
        self.fmt, self.forced = fmt, forced
        self.sent = 0  # text characters handled (sent as content or consumed by calls)
        self.calls: list[ToolCall] = []

    def feed(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        """(content to send now, calls completed now)."""
        if self.fmt != "hermes" or (self.forced and not final):
            if not final:
                return "", []
            content, calls = parse_tool_calls(text[self.sent:], self.fmt)
            self.sent = len(text)
            self.calls += calls
            return ("" if self.forced or calls else (content or "")), calls
        out, new = [], []
        while True:
            rest = text[self.sent:]
            start = rest.find(self.OPEN)
            if start < 0:
                hold = 0 if final else _partial_suffix(rest, self.OPEN)
                out.append(rest[: len(rest) - hold])
                self.sent += len(rest) - hold
                break
            end = rest.find("</tool_call>", start)
            if end < 0 and not final:
                out.append(rest[:start])
                self.sent += start
                break
            stop = len(rest) if end < 0 else end + len("</tool_call>")
            _, calls = parse_tool_calls(rest[start:stop], "hermes")
            out.append(rest[:start] if calls else rest[:stop])
            new += calls
            self.sent += stop
        self.calls += new
        return "".join(out), new


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
