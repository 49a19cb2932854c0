"""``kvos serve --prefill-engines 1 --decode-engines 1`` (engines as local processes, no Ray):
a real HTTP client against the disaggregated server on the default model. Each request is
prefilled on one engine and generated on the other, with its prompt's blocks moved between
them, unless the decode engine already holds them all."""
from __future__ import annotations

import httpx
import openai
import pytest

from kvos import SamplingParams
from tests.support.server import Server

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
SYSTEM = "You answer questions about operating systems. " * 12


@pytest.fixture(scope="module")
def server():
    s = Server("--prefill-engines", "1", "--decode-engines", "1", "--transport", "process", "--kv-transfer-gb", "0.05",
               "--max-model-len", "1024", "--num-blocks", "128").wait_ready(timeout=600)
    yield s
    assert s.stop() == 0
    assert "did not stop" not in s.output()  # the engine processes shut down when asked, not killed


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


def test_outputs_equal_one_engine_streamed_or_not(server, client, llm):
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok", "engines_up": 1, "prefill_engines_up": 1}
    prompts = [SYSTEM + "What is a page table? " * 6, SYSTEM + "What does the scheduler do? " * 6]
    refs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    before = server.metric("kvos:router_prefills_total")
    for prompt, ref in zip(prompts, refs):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
        assert r.choices[0].text == ref.outputs[0].text
        stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in stream if c.choices) == ref.outputs[0].text
    # each prompt's first request goes through the prefill engine; its repeat finds every full
    # block on the decode engine already and goes straight there
    assert server.metric("kvos:router_prefills_total") - before == 2


def test_a_chat_turn_finds_its_history_cached_on_the_decode_engine(server, client):
    """The second turn's prompt extends the first: the decode engine reports the first turn's full
    blocks as cached (moved there or kept from the first turn), and only new blocks move."""
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is virtual memory?"}]
    moved0 = server.metric("kvos:router_transferred_blocks_total")
    r1 = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0)
    moved1 = server.metric("kvos:router_transferred_blocks_total")
    assert r1.usage.prompt_tokens_details.cached_tokens == (r1.usage.prompt_tokens - 1) // 16 * 16
    assert moved1 - moved0 == (r1.usage.prompt_tokens - 1) // 16  # a new prompt: all its full blocks move
    msgs += [{"role": "assistant", "content": r1.choices[0].message.content},
             {"role": "user", "content": "And what is a TLB?"}]
    r2 = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0)
    full1, full2 = (r1.usage.prompt_tokens - 1) // 16, (r2.usage.prompt_tokens - 1) // 16
    assert r2.usage.prompt_tokens_details.cached_tokens == full2 * 16
    assert server.metric("kvos:router_transferred_blocks_total") - moved1 == full2 - full1
