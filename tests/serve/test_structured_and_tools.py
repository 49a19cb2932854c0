"""Structured outputs and tool calling through the real openai client against a real
``kvos serve`` on the default model (SmolLM2-135M-Instruct, whose chat template does not render
tools: kvos describes them in the Hermes format and forces calls with the grammar)."""
from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

MODEL = "SmolLM2-135M-Instruct"
CITY = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
        "properties": {"city": {"type": "string", "maxLength": 16}, "unit": {"enum": ["celsius", "fahrenheit"]}}}
ADD = {"type": "object", "additionalProperties": False, "required": ["a", "b"],
       "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                      "b": {"type": "integer", "minimum": -99, "maximum": 99}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": CITY}},
         {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": ADD}}]
SCHEMAS = {"get_weather": CITY, "add": ADD}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def check_calls(calls, names=None):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert names is None or call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_response_formats_validate_streamed_and_not(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": CITY, "strict": True}}
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=60, n=3, temperature=1.0, seed=5,
                                       response_format=fmt)
    for c in r.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), CITY)
    text = "".join(ch.choices[0].delta.content or "" for ch in client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=60, temperature=1.0, seed=6, response_format=fmt, stream=True)
        if ch.choices)
    jsonschema.validate(json.loads(text), CITY)
    obj = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=80, temperature=0,
                                         response_format={"type": "json_object"})
    assert obj.choices[0].finish_reason != "stop" or isinstance(json.loads(obj.choices[0].message.content), dict)


def test_vllm_guided_fields_on_completions(client):
    for extra, check in [({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
                         ({"guided_regex": "[0-9]{3}-[0-9]{4}"}, lambda t: len(t) == 8 and t[3] == "-"),
                         ({"structured_outputs": {"json": ADD}}, lambda t: jsonschema.validate(json.loads(t), ADD)
                          is None),
                         ({"guided_grammar": 'root ::= "ab" [0-9]'}, lambda t: t[:2] == "ab" and t[2].isdigit())]:
        r = client.completions.create(model=MODEL, prompt="Answer:", max_tokens=40, temperature=1.0, seed=1, n=2,
                                      extra_body=extra)
        for c in r.choices:
            assert check(c.text), (extra, c.text)
        chunks = client.completions.create(model=MODEL, prompt="Answer:", max_tokens=40, temperature=1.0, seed=2,
                                           extra_body=extra, stream=True)
        assert check("".join(ch.choices[0].text for ch in chunks if ch.choices)), extra
    broken = client.completions.create(model=MODEL, prompt="hi", max_tokens=12, temperature=0,
                                       extra_body={"guided_regex": "a{1000000}"})  # llguidance gives up mid-way
    choice = broken.choices[0]
    assert choice.finish_reason == "abort"
    assert "guided_regex: the constraint failed" in choice.model_extra["stop_reason"]


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format.json_schema.json"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"guided_regex": "[a-"}, "guided_regex.regex"),
    ({"guided_choice": []}, "guided_choice.choice"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools.0.function.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
])
def test_bad_constraints_are_400s_naming_the_field(server, body, param):
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_required_and_named_tool_choices_always_return_valid_calls(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                       max_tokens=120, n=3, temperature=1.0, seed=3)
    for c in r.choices:
        assert c.finish_reason == "tool_calls", c.message
        check_calls(c.message.tool_calls)
    named = {"type": "function", "function": {"name": "add"}}
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "What is 2 plus 3?"}],
                                       tools=TOOLS, tool_choice=named, max_tokens=60, n=2, temperature=1.0, seed=4)
    for c in r.choices:
        assert len(c.message.tool_calls) == 1
        check_calls(c.message.tool_calls, {"add"})


def test_streamed_tool_call_deltas_reassemble_to_the_call(client):
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice={"type": "function",
                                                                    "function": {"name": "get_weather"}},
              max_tokens=60, temperature=0)
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls
    calls: dict[int, dict] = {}
    reasons = []
    for ch in client.chat.completions.create(**kw, stream=True):
        for choice in ch.choices:
            reasons.append(choice.finish_reason)
            for d in choice.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = d.id or call["id"]
                if d.function is not None:
                    call["name"] += d.function.name or ""
                    call["arguments"] += d.function.arguments or ""
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == \
        [(w.function.name, json.loads(w.function.arguments)) for w in whole]
    assert all(c["id"].startswith("call_") for c in calls.values()) and reasons[-1] == "tool_calls"


def test_two_turn_tool_conversation(client):
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                           max_tokens=80, temperature=0, parallel_tool_calls=False)
    msg = first.choices[0].message
    assert len(msg.tool_calls) == 1
    call = msg.tool_calls[0]
    history = [*ASK, {"role": "assistant", "content": None,
                      "tool_calls": [{"id": call.id, "type": "function",
                                      "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
               {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18, "sky": "clear"})}]
    second = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="none",
                                            max_tokens=30, temperature=0)
    c = second.choices[0]
    assert c.message.content and not c.message.tool_calls and c.finish_reason in ("stop", "length")
    auto = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=30, temperature=0)
    assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_langchain_bind_tools(server):
    """LangChain's ChatOpenAI reads kvos's calls as it reads OpenAI's."""
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(model=MODEL, base_url=f"{server.url}/v1", api_key="unused", temperature=0, max_tokens=60,
                      max_retries=0)
    msg = chat.bind_tools(TOOLS, tool_choice="get_weather").invoke("What is the weather in Paris?")
    assert [c["name"] for c in msg.tool_calls] == ["get_weather"]
    jsonschema.validate(msg.tool_calls[0]["args"], CITY)
