"""Stop strings that span several tokens: streamed text equals the final text, whatever the
split point (the engine holds back text that could still become a stop string), through the
engine and through the real server with the ``openai`` client."""
from __future__ import annotations

import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvos import SamplingParams

pytestmark = pytest.mark.slow

PROMPT = [{"role": "user", "content": "Tell me a short story about a lighthouse keeper."}]
N_TOKENS = 24


@pytest.fixture(scope="module")
def reference_text(llm):
    out = llm.chat(PROMPT, SamplingParams(temperature=0, max_tokens=N_TOKENS, ignore_eos=True), use_tqdm=False)
    text = out[0].outputs[0].text
    assert len(text) > 60
    return text


def stream(llm, stop: list[str], include: bool = False) -> tuple[list[str], str, str | None]:
    """Drive the engine step by step: every intermediate text, the final text, the stop reason."""
    eng = llm.engine
    rid = eng.add_request({"prompt_token_ids": llm.chat_token_ids(PROMPT)},
                          SamplingParams(temperature=0, max_tokens=N_TOKENS, ignore_eos=True, stop=stop,
                                         include_stop_str_in_output=include))
    texts, final = [], None
    while final is None:
        for o in eng.step():
            if o.request_id == rid:
                texts.append(o.outputs[0].text)
                if o.finished:
                    final = o.outputs[0]
    return texts, final.text, final.stop_reason


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(start=st.integers(0, 10_000), length=st.integers(2, 12), include=st.booleans())
def test_streamed_text_is_never_revised_and_equals_the_final_text(llm, reference_text, start, length, include):
    start %= len(reference_text) - length
    stop = reference_text[start: start + length]
    texts, final, reason = stream(llm, [stop], include)
    for a, b in zip(texts, texts[1:]):
        assert b.startswith(a), (a, b)  # a delta is never taken back
    assert texts[-1] == final
    cut = reference_text.find(stop)
    assert reason == stop
    assert final == reference_text[: cut + (len(stop) if include else 0)]
    for t in texts[:-1]:  # nothing of the stop string leaks before the end
        assert len(t) <= cut


COMPLETION_PROMPT = "The story of the lighthouse keeper began"


def server_text(client: openai.OpenAI, endpoint: str, stop: list[str] | None, stream: bool) -> str:
    kw = dict(model="SmolLM2-135M-Instruct", max_tokens=N_TOKENS, temperature=0, stop=stop, stream=stream,
              extra_body={"ignore_eos": True})
    if endpoint == "chat":
        r = client.chat.completions.create(messages=PROMPT, **kw)
        return "".join(c.choices[0].delta.content or "" for c in r if c.choices) if stream else \
            r.choices[0].message.content
    r = client.completions.create(prompt=COMPLETION_PROMPT, **kw)
    return "".join(c.choices[0].text for c in r if c.choices) if stream else r.choices[0].text


@pytest.fixture(scope="module")
def server_reference(client):
    return {e: server_text(client, e, None, False) for e in ("chat", "completions")}


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(start=st.integers(0, 10_000), length=st.integers(2, 12))
def test_streaming_equals_non_streaming_through_the_server(client, server_reference, reference_text, endpoint,
                                                           start, length):
    """Random stop strings cut from the server's own output, so they span tokens and split them
    anywhere: streamed text equals the non-streamed text, which ends just before the stop."""
    ref = server_reference[endpoint]
    if endpoint == "chat":
        assert ref == reference_text  # the server and the engine agree
    start %= len(ref) - length
    stop = [ref[start: start + length]]
    full = server_text(client, endpoint, stop, stream=False)
    assert server_text(client, endpoint, stop, stream=True) == full
    assert full == ref[: ref.find(stop[0])]
