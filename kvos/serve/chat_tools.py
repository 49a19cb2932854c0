"""A chat request's tools: what the prompt shows, what the grammar forces, how replies are read.

``ChatTools.prompt`` gives the messages (and the tool list) for the chat template: a template
that renders tools itself gets them as HF templates take them (calls' arguments as objects);
any other template gets kvos's description of the tools in the system turn and earlier calls
and results written in the Hermes format (``kvos.structured.tool_calls``).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from kvos.core.structured_outputs import StructuredOutputsParams
from kvos.structured.tool_calls import (
    Tool,
    call_grammar,
    hermes_history,
    parse_tool_calls,
    parse_tool_choice,
    parse_tools,
    pick_parser,
    tools_system_text,
)


def template_renders_tools(tokenizer) -> bool:
    return "tools" in (getattr(tokenizer, "chat_template", None) or "")


@dataclass
class ChatTools:
    tools: list[Tool]
    choice: str
    """``none``, ``auto``, ``required`` or ``function:<name>``."""
    parallel: bool
    parser: str
    native: bool
    """The chat template renders the tools itself."""

    @classmethod
    def of(cls, body, tokenizer, parser: str | None = None) -> ChatTools:
        """A chat request's ``tools``, ``tool_choice`` and ``parallel_tool_calls``."""
        return cls.make(body.tools, body.tool_choice, body.parallel_tool_calls, tokenizer, parser)

    @classmethod
    def make(cls, tools: list[dict] | None, tool_choice, parallel: bool | None, tokenizer,
             parser: str | None = None) -> ChatTools:
        """``tools`` and ``tool_choice`` in the chat API's shape; ValueErrors name those fields."""
        parsed = parse_tools(tools) if tools is not None else []
        choice = parse_tool_choice(tool_choice, parsed)
        template = getattr(tokenizer, "chat_template", None)
        native = template_renders_tools(tokenizer)
        fmt = parser or (pick_parser(template) if native else "hermes")
        return cls(parsed, choice, parallel is not False, fmt, native)

    @property
    def active(self) -> bool:
        """The model may call tools (their calls are parsed out of its replies)."""
        return bool(self.tools) and self.choice != "none"

    @property
    def forced(self) -> bool:
        """The reply must be tool calls (``required`` or a named function): a grammar holds it."""
        return self.choice == "required" or self.choice.startswith("function:")

    def grammar(self) -> StructuredOutputsParams:
        return StructuredOutputsParams(grammar=call_grammar(self.tools, self.choice, self.parallel, self.parser),
                                       field_name="tool_choice")

    def prompt(self, messages: list[dict]) -> tuple[list[dict], list[dict] | None]:
        """(messages for the template, ``tools`` for the template or None)."""
        shown = self.tools if self.active else []
        if self.native:
            msgs = [_native(m) for m in messages]
            return msgs, [t.as_openai() for t in shown] or None
        msgs = hermes_history(messages) if any(m.get("tool_calls") or m["role"] == "tool" for m in messages) \
            else messages
        if shown:
            text = tools_system_text(shown)
            if msgs and msgs[0]["role"] == "system":
                msgs = [{**msgs[0], "content": msgs[0]["content"] + "\n\n" + text}, *msgs[1:]]
            else:
                msgs = [{"role": "system", "content": text}, *msgs]
        return msgs, None

    def parse(self, text: str):
        """(content, calls) of a finished reply; no calls when tools are not active."""
        if not self.active:
            return text, []
        return parse_tool_calls(text, self.parser)


def _native(m: dict) -> dict:
    """HF chat templates take a call's arguments as an object."""
    if not m.get("tool_calls"):
        return m
    calls = []
    for c in m["tool_calls"]:
        args = c["function"]["arguments"]
        try:
            args = json.loads(args)
        except (TypeError, ValueError):
            pass
        calls.append({"id": c.get("id"), "type": "function", "function": {"name": c["function"]["name"],
                                                                        "arguments": args}})
    return {**m, "tool_calls": calls}
