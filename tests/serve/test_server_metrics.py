"""/metrics counters asserted against what the test sent and caused, on a server with a pool of
40 blocks of 8 tokens (39 usable; block 0 is the null block), no warm-up, prompts as token ids.

The expected figures follow from the pool's stated rules, not from kvos's own counters: a
prompt's full blocks are cached when it finishes, the last prompt token is always computed
(a hit covers at most ``(len - 1) // 8`` blocks), never-cached free blocks are reused before
any cached block is evicted, a freed chain is evicted tail first (LRU), and the latest arrival
is the one preempted."""
from __future__ import annotations

import asyncio
import random

import openai
import pytest

from kvos import SamplingParams
from tests.support.server import Server

MODEL = "SmolLM2-135M-Instruct"
BLOCK = 8
USABLE_BLOCKS = 39
COUNTERS = {
    "hits": "kvos:prefix_cache_hits_total", "queries": "kvos:prefix_cache_queries_total",
    "evictions": "kvos:kv_cache_evictions_total", "preemptions": "kvos:num_preemptions_total",
    "prompt": "kvos:prompt_tokens_total", "generated": "kvos:generation_tokens_total",
}


@pytest.fixture(scope="module")
def server():
    s = Server("--max-model-len", "256", "--num-blocks", "40", "--block-size", str(BLOCK), "--no-warmup").wait_ready()
    yield s
    s.stop()


def counters(server: Server) -> dict[str, float]:
    out = {k: server.metric(name) for k, name in COUNTERS.items()}
    for reason in ("stop", "length", "abort"):
        out[reason] = server.metric("kvos:request_success_total", f'finished_reason="{reason}"')
    return out


def token_prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(n)]


def test_counters_match_hits_evictions_and_requests(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    start = counters(server)
    assert start["hits"] == start["queries"] == start["evictions"] == start["preemptions"] == 0

    def complete(prompt: list[int], max_tokens: int = 1):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0)
        assert r.usage.prompt_tokens == len(prompt)
        return r

    p = token_prompt(1, 10 * BLOCK + 1)  # 10 full blocks + 1 token
    q = token_prompt(2, 31 * BLOCK)  # 31 full blocks
    first, second = complete(p), complete(p)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 10 * BLOCK
    # P's 10 blocks stay cached; Q needs 31 of the 29 never-cached blocks: P's last 2 are evicted
    complete(q)
    third = complete(p)
    assert third.usage.prompt_tokens_details.cached_tokens == 8 * BLOCK
    # P needs 3 more blocks and only Q's cached blocks are left: 3 more evictions
    sent = [first, second, third]
    end = counters(server)
    reported = sum(r.usage.prompt_tokens_details.cached_tokens for r in sent)
    assert end["hits"] - start["hits"] == reported == 18 * BLOCK
    assert end["queries"] - start["queries"] == 3 * len(p) + len(q)
    assert end["evictions"] - start["evictions"] == 2 + 3
    assert end["preemptions"] - start["preemptions"] == 0
    assert end["length"] - start["length"] == 4 and end["stop"] == start["stop"]
    assert end["prompt"] - start["prompt"] == 3 * len(p) + len(q)
    assert end["generated"] - start["generated"] == 4


def test_preemption_is_counted_once_and_changes_no_token(server, llm):
    """Two requests of 100 + 60 tokens (20 blocks each at the end) cannot both finish in 39
    blocks: the later one (one token behind) is preempted once, when both reach 20 blocks, and
    cannot come back before the first finishes (its 20 blocks beside the first's 20 do not fit)."""
    a, b = token_prompt(3, 100), token_prompt(4, 100)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    refs = [o.outputs[0].text for o in llm.generate([{"prompt_token_ids": x} for x in (a, b)], params,
                                                     use_tqdm=False)]
    start = counters(server)

    async def run() -> tuple[list, object]:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        kw = dict(model=MODEL, max_tokens=60, temperature=0, extra_body={"ignore_eos": True})
        stream_a = await client.completions.create(prompt=a, stream=True, stream_options={"include_usage": True},
                                                   **kw)
        chunks_a = [await anext(stream_a)]  # A is running before B arrives

        async def rest_of_a() -> list:
            return chunks_a + [c async for c in stream_a]

        return await asyncio.gather(rest_of_a(), client.completions.create(prompt=b, **kw))

    chunks_a, resp_b = asyncio.run(run())
    assert "".join(c.choices[0].text for c in chunks_a if c.choices) == refs[0]
    assert chunks_a[-1].usage.completion_tokens == 60
    assert resp_b.choices[0].text == refs[1] and resp_b.usage.completion_tokens == 60
    end = counters(server)
    assert end["preemptions"] - start["preemptions"] == 1
    assert end["length"] - start["length"] == 2
    assert end["prompt"] - start["prompt"] == 200 and end["generated"] - start["generated"] == 120


def test_pinned_prefix_survives_a_flood_through_the_api(server):
    """POST /v1/cache/pins keeps a prefix's blocks through traffic that evicts everything else;
    the pin is listed, deleted once (then 404), and one over the cap is a 400 naming it."""
    import httpx

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    system = token_prompt(7, 5 * BLOCK)
    r = httpx.post(f"{server.url}/v1/cache/pins", json={"prompt": system, "ttl_s": 120}, timeout=60)
    assert r.status_code == 200, r.text
    pin = r.json()
    assert pin["pinned_tokens"] == 5 * BLOCK and pin["pinned_blocks"] == 5 and 0 < pin["expires_in_s"] <= 120
    before = server.metric("kvos:kv_cache_evictions_total")
    for seed in (8, 9):  # each fills the pool: everything not pinned is evicted
        client.completions.create(model=MODEL, prompt=token_prompt(seed, 25 * BLOCK), max_tokens=1)
    assert server.metric("kvos:kv_cache_evictions_total") > before
    hit = client.completions.create(model=MODEL, prompt=system + token_prompt(10, BLOCK), max_tokens=1)
    assert hit.usage.prompt_tokens_details.cached_tokens == 5 * BLOCK
    listed = httpx.get(f"{server.url}/v1/cache/pins").json()["data"]
    assert [p["id"] for p in listed] == [pin["id"]]
    assert httpx.delete(f"{server.url}/v1/cache/pins/{pin['id']}").json()["deleted"] is True
    gone = httpx.delete(f"{server.url}/v1/cache/pins/{pin['id']}")
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "pin_not_found"
    for seed in (11, 12):
        client.completions.create(model=MODEL, prompt=token_prompt(seed, 25 * BLOCK), max_tokens=1)
    after = client.completions.create(model=MODEL, prompt=system + token_prompt(13, BLOCK), max_tokens=1)
    assert after.usage.prompt_tokens_details.cached_tokens == 0  # unpinned, it went with the rest
    big = httpx.post(f"{server.url}/v1/cache/pins", json={"prompt": token_prompt(14, 25 * BLOCK)}, timeout=60)
    assert big.status_code == 400 and "max_pinned_fraction" in big.json()["error"]["message"]
    assert big.json()["error"]["param"] == "prompt"
    bad = httpx.post(f"{server.url}/v1/cache/pins", json={"prompt": system, "ttl_s": -1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "ttl_s"
