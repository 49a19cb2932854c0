"""OpenAI's Responses API (``/v1/responses``) through the official openai client against the
shared ``kvos serve`` (SmolLM2-135M-Instruct), with ``/v1/chat/completions`` as the reference:
both routes render the same prompt, so greedy answers are equal. Every event of a stream is
validated against the SDK's own pydantic types, and ``client.responses.stream`` checks that the
events build the final response."""
from __future__ import annotations

import asyncio
import json
import uuid

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from kvos.core.outputs import CompletionOutput, RequestOutput
from kvos.engine.client import RequestFailed
from kvos.serve.chat_tools import ChatTools
from kvos.serve.responses_api import ResponseStore, StoredResponse
from kvos.serve.responses_output import ResponseDraft, response_events
from kvos.serve.responses_protocol import ResponsesRequest

MODEL = "SmolLM2-135M-Instruct"
CITY = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
        "properties": {"city": {"type": "string", "maxLength": 16}, "unit": {"enum": ["celsius", "fahrenheit"]}}}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather in a city",
          "parameters": CITY, "strict": True}]
EVENTS = TypeAdapter(ResponseStreamEvent)


def raw_events(server, body: dict) -> list:
    """A streamed response's events, each validated by the SDK's types (not just constructed)."""
    events = []
    with httpx.stream("POST", f"{server.url}/v1/responses", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(EVENTS.validate_python(json.loads(line[6:])))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events


def chat_text(client, messages: list[dict], max_tokens: int) -> str:
    r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=max_tokens)
    return r.choices[0].message.content


def test_greedy_text_equals_chat_completions(client, server):
    r = client.responses.create(model=MODEL, instructions="Answer in one sentence.", input="Name a color.",
                                temperature=0, max_output_tokens=8)
    c = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=8, messages=[
        {"role": "system", "content": "Answer in one sentence."}, {"role": "user", "content": "Name a color."}])
    assert r.id.startswith("resp_") and r.object == "response"
    assert r.output_text == c.choices[0].message.content
    assert r.usage.input_tokens == c.usage.prompt_tokens and r.usage.output_tokens == c.usage.completion_tokens
    assert r.status == ("incomplete" if c.choices[0].finish_reason == "length" else "completed")
    assert (r.instructions, r.temperature, r.max_output_tokens, r.store) == ("Answer in one sentence.", 0, 8, True)
    msg = r.output[0]
    assert msg.type == "message" and msg.id.startswith("msg_") and msg.content[0].annotations == []
    Response.model_validate(httpx.get(f"{server.url}/v1/responses/{r.id}").json())  # stored, and the full shape

    # a list of items (parts, an earlier assistant turn, a developer message) renders as the chat does
    items = [{"role": "developer", "content": "Be terse."},
             {"role": "user", "content": [{"type": "input_text", "text": "Hi!"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
             {"role": "user", "content": "Count to three."}]
    r = client.responses.create(model=MODEL, input=items, temperature=0, max_output_tokens=10)
    assert r.output_text == chat_text(client, [{"role": "developer", "content": "Be terse."},
                                               {"role": "user", "content": "Hi!"},
                                               {"role": "assistant", "content": "Hello."},
                                               {"role": "user", "content": "Count to three."}], 10)


def test_streamed_deltas_join_to_the_text(client, server):
    body = {"model": MODEL, "input": "Say hello.", "temperature": 0, "max_output_tokens": 40}
    whole = client.responses.create(**body)
    assert whole.status == "completed"
    events = raw_events(server, body)
    kinds = [e.type for e in events]
    assert kinds[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    assert events[-1].response.output[0].id == events[2].item.id
    with client.responses.stream(**body) as stream:  # the SDK's own checks of the events
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert final.output_text == deltas == text and final.usage.output_tokens == whole.usage.output_tokens


def test_max_output_tokens_makes_an_incomplete_response(client, server):
    r = client.responses.create(model=MODEL, input="Tell me a long story.", max_output_tokens=2, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 2 and r.output[0].status == "incomplete"
    no_tools = client.responses.create(model=MODEL, input="Hi", tools=[], tool_choice="auto", max_output_tokens=2)
    assert no_tools.tools == [] and no_tools.usage.output_tokens == 2
    last = raw_events(server, {"input": "Tell me a long story.", "max_output_tokens": 2})[-1]
    assert last.type == "response.incomplete" and last.response.incomplete_details.reason == "max_output_tokens"


def test_forced_function_call_then_its_output_continues(client, server):
    ask = "What is the weather in Paris?"
    kw = dict(model=MODEL, tools=TOOLS, tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
              max_output_tokens=60)
    r = client.responses.create(input=ask, **kw)
    assert [o.type for o in r.output] == ["function_call"] and r.status == "completed"
    call = r.output[0]
    assert call.name == "get_weather" and call.id.startswith("fc_") and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), CITY)

    with client.responses.stream(input=ask, **kw) as stream:  # streamed: the same call, parsed by the SDK
        added = [e.item.name for e in stream if e.type == "response.output_item.added"]
        streamed = stream.get_final_response().output
    assert added == ["get_weather"] and streamed[0].arguments == call.arguments
    assert streamed[0].parsed_arguments == json.loads(call.arguments)
    events = raw_events(server, {"input": ask, **{k: v for k, v in kw.items() if k != "model"}})
    assert "response.function_call_arguments.done" in [e.type for e in events]

    result = {"type": "function_call_output", "call_id": call.call_id, "output": json.dumps({"celsius": 18})}
    follow = dict(tools=TOOLS, temperature=0, max_output_tokens=20, model=MODEL)
    chained = client.responses.create(previous_response_id=r.id, input=[result], **follow)
    stateless = client.responses.create(input=[{"role": "user", "content": ask}, *r.output, result], **follow)
    assert chained.output_text == stateless.output_text and chained.output[0].type == "message"
    assert chained.previous_response_id == r.id
    assert chained.usage.input_tokens_details.cached_tokens > 0


def test_previous_response_id_continues_from_the_cache(client, server):
    block = httpx.get(f"{server.url}/v1/kv/summary").json()["block_size"]
    first_q = f"My name is Ada {uuid.uuid4().hex[:8]}. Remember it."
    first = client.responses.create(model=MODEL, input=first_q, temperature=0, max_output_tokens=12)
    second = client.responses.create(model=MODEL, input="What is my name?", previous_response_id=first.id,
                                     temperature=0, max_output_tokens=12)
    assert second.output_text == chat_text(client, [{"role": "user", "content": first_q},
                                                    {"role": "assistant", "content": first.output_text},
                                                    {"role": "user", "content": "What is my name?"}], 12)
    cached = second.usage.input_tokens_details.cached_tokens
    assert cached > first.usage.input_tokens_details.cached_tokens
    assert cached >= first.usage.input_tokens // block * block  # the whole first prompt's full blocks

    assert client.responses.retrieve(second.id).output_text == second.output_text
    client.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second.id)
    unstored = client.responses.create(model=MODEL, input="Hi", store=False, max_output_tokens=2)
    for rid in (unstored.id, "resp_unknown"):
        with pytest.raises(openai.NotFoundError) as e:
            client.responses.create(model=MODEL, input="Hi", previous_response_id=rid, max_output_tokens=2)
        assert e.value.body["param"] == "previous_response_id"
        assert e.value.body["code"] == "previous_response_not_found"


def test_text_formats_give_valid_json(client, server):
    fmt = {"format": {"type": "json_schema", "name": "weather", "schema": CITY, "strict": True}}
    r = client.responses.create(model=MODEL, input="The weather in Paris, as JSON.", text=fmt, temperature=1.0,
                                max_output_tokens=60)
    jsonschema.validate(json.loads(r.output_text), CITY)
    assert r.text.format.type == "json_schema"
    events = raw_events(server, {"input": "The weather in Oslo, as JSON.", "text": fmt, "max_output_tokens": 60})
    jsonschema.validate(json.loads(events[-1].response.output_text), CITY)
    obj = client.responses.create(model=MODEL, input="A JSON object, please.", max_output_tokens=60, temperature=0,
                                  text={"format": {"type": "json_object"}})
    assert obj.status != "completed" or isinstance(json.loads(obj.output_text), dict)


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"tools": [{"type": "function", "name": "bad name"}]}, "tools.0.name"),
    ({"tools": [{**TOOLS[0], "strict": "yes"}]}, "tools.0.strict"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"background": True}, "background"),
    ({"truncation": "auto"}, "truncation"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": 100000}, "max_output_tokens"),
    ({"temperature": "0"}, "temperature"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "foo"}}}}, "text.format.schema"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]},
     "input.0.content.0.type"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input.0.type"),
    ({"input": [{"role": "user", "content": "hi", "foo": 1}]}, "input.0.foo"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input.0.call_id"),
    ({"input": []}, "input"),
])
def test_bad_fields_are_400s_naming_the_field(server, body, param):
    r = httpx.post(f"{server.url}/v1/responses", json={"input": "Hi", "max_output_tokens": 4, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_the_store_is_a_bounded_lru_per_tenant():
    store = ResponseStore(capacity=2)
    for rid in ("a", "b"):
        store.put(rid, StoredResponse({"id": rid}, [], None))
    assert store.get("a", None) is not None  # refreshed: "b" is now the oldest
    store.put("c", StoredResponse({"id": "c"}, [], "tenant-1"))
    assert len(store) == 2 and store.get("b", None) is None
    assert store.get("c", None) is None and store.get("c", "tenant-1") is not None
    assert not store.delete("c", None) and store.delete("c", "tenant-1")


def test_an_engine_error_mid_stream_ends_with_an_error_event():
    class FailingStream:
        last = None

        async def __aiter__(self):
            yield RequestOutput("r", None, [1, 2], [CompletionOutput(0, "Hel", [3])], False)
            raise RequestFailed("injected fault")

    body = ResponsesRequest.model_validate({"input": "Hi"})
    draft = ResponseDraft("resp_x", body, MODEL, 1.0, 1.0, ChatTools.make(None, None, None, None))

    async def run() -> list[str]:
        return [e async for e in response_events(None, FailingStream(), draft, lambda _: None)]

    events = [EVENTS.validate_python(json.loads(chunk.split("data: ", 1)[1])) for chunk in asyncio.run(run())]
    assert [e.type for e in events][-2:] == ["response.output_text.delta", "error"]
    assert events[-1].code == "engine_error" and events[-1].message == "injected fault"
