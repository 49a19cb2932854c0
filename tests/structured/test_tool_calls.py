"""Tool-call parsing and the streamed splitter, on replies written as models write them."""
from __future__ import annotations

import json

import pytest

from kvos.structured.tool_calls import ToolCallStream, parse_tool_calls, parse_tool_choice, parse_tools, pick_parser

TOOLS = parse_tools([{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}},
                     {"type": "function", "function": {"name": "get_weather"}}])


def calls(text, fmt):
    content, found = parse_tool_calls(text, fmt)
    return content, [(c.name, json.loads(c.arguments)) for c in found]


def test_hermes_calls_and_the_content_around_them():
    text = ('Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
            '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}</tool_call>')
    assert calls(text, "hermes") == ("Let me add.", [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Oslo"})])
    broken = 'x <tool_call>{"name": "add", "arguments": {"a": </tool_call>'
    assert calls(broken, "hermes") == (broken, [])  # not a whole call: stays content
    assert calls("no calls here", "hermes") == ("no calls here", [])


def test_llama3_json_calls():
    text = '<|python_tag|>{"name": "add", "parameters": {"a": 1}}; {"name": "get_weather", "parameters": {}}'
    assert calls(text, "llama3_json") == (None, [("add", {"a": 1}), ("get_weather", {})])
    assert calls("The answer is 3.", "llama3_json") == ("The answer is 3.", [])
    assert calls('{"weather": "sunny"}', "llama3_json") == ('{"weather": "sunny"}', [])


@pytest.mark.parametrize("fmt, forced, text", [
    ("hermes", False, 'Sure <tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call> done <tool'),
    ("hermes", True, '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>\n<tool_call>\n'
                     '{"name": "get_weather", "arguments": {}}\n</tool_call>'),
    ("llama3_json", False, '{"name": "add", "parameters": {"a": 1}}'),
])
def test_streamed_pieces_reassemble_to_the_parsed_reply(fmt, forced, text):
    stream, content, found = ToolCallStream(fmt, forced), "", []
    for end in range(1, len(text) + 1):  # one character at a time: the worst split
        piece, new = stream.feed(text[:end], end == len(text))
        content += piece
        found += new
        assert "<tool_call>" not in content
    ref_content, ref_calls = parse_tool_calls(text, fmt)
    assert [(c.name, c.arguments) for c in found] == [(c.name, c.arguments) for c in ref_calls]
    assert content.strip() == ("" if forced or fmt != "hermes" else (ref_content or "").strip())


def test_tool_and_choice_errors_name_the_field():
    with pytest.raises(ValueError, match=r"^tools\.1\.function\.name: "):
        parse_tools([{"type": "function", "function": {"name": "a"}}, {"type": "function", "function": {"name": "a"}}])
    with pytest.raises(ValueError, match=r"^tool_choice\.function\.name: "):
        parse_tool_choice({"type": "function", "function": {"name": "nope"}}, TOOLS)
    assert parse_tool_choice(None, TOOLS) == "auto" and parse_tool_choice(None, []) == "none"
    assert pick_parser("{{ '<|python_tag|>' }}") == "llama3_json" and pick_parser(None) == "hermes"


def test_forced_calls_are_capped_at_one_per_tool():
    """A small model repeats calls until max_tokens unless the grammar ends them: with
    ``required`` the reply holds at most ``len(tools)`` calls."""
    from kvos.core.structured_outputs import StructuredOutputsParams
    from kvos.models.loader import default_model_path, load_tokenizer
    from kvos.structured.grammars import GrammarCompiler
    from kvos.structured.tool_calls import call_grammar

    tok = load_tokenizer(default_model_path())
    compiler = GrammarCompiler(tok, tok.eos_token_id, len(tok))
    one = '<tool_call>\n{"name":"get_weather","arguments":{}}\n</tool_call>'
    for tools, calls_ok in ((TOOLS[1:], 1), (TOOLS, 2)):
        m = compiler.matcher(StructuredOutputsParams(grammar=call_grammar(tools, "required", True, "hermes")))
        for k in range(calls_ok):
            assert m.consume_tokens(tok(("\n" if k else "") + one, add_special_tokens=False).input_ids)
        assert m.is_stopped(), f"more than {calls_ok} calls allowed"
