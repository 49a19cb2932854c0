"""Speculative decoding through `kvos serve --speculative-config` with the OpenAI client: greedy
completions equal the in-process engine's plain decoding, /metrics counts drafts and
acceptances, a request with ``"speculative": false`` proposes none, and a bad config stops the
server at start with the key named. The same server (two sequences at a time) checks that the
queue gauges add up: running + waiting = sequences in flight."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import httpx

import openai
import pytest

from kvos import SamplingParams
from tests.engine.test_speculative import CODE, NGRAM, QUOTE
from tests.support.server import Server

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server():
    s = Server("--max-model-len", "1024", "--kv-cache-memory-bytes", str(64 << 20), "--no-warmup", "--max-num-seqs", "2",
               "--speculative-config", json.dumps(NGRAM)).wait_ready()
    yield s
    s.stop()


def test_completions_match_plain_decoding_and_metrics_count_drafts(server, llm):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    plain = llm.generate([QUOTE, CODE], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
                         use_tqdm=False)
    for prompt, ref in zip([QUOTE, CODE], plain):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=32, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.choices[0].text == ref.outputs[0].text
    drafts = server.metric("kvos:spec_decode_num_drafts_total")
    accepted = server.metric("kvos:spec_decode_num_accepted_tokens_total")
    assert drafts > 0 and 0 < accepted <= server.metric("kvos:spec_decode_num_draft_tokens_total")
    assert server.metric("kvos:spec_decode_num_accepted_tokens_per_pos_total", 'position="0"') > 0
    client.completions.create(model=MODEL, prompt=QUOTE, max_tokens=16, temperature=0,
                              extra_body={"speculative": False})
    assert server.metric("kvos:spec_decode_num_drafts_total") == drafts
    with pytest.raises(openai.BadRequestError, match="speculative"):
        client.completions.create(model=MODEL, prompt=QUOTE, max_tokens=4, extra_body={"speculative": "maybe"})


def test_a_bad_speculative_config_stops_the_server_naming_the_key():
    r = subprocess.run([sys.executable, "-m", "kvos.cli", "serve", "--speculative-config",
                        '{"method": "ngram", "num_speculative_tokenz": 3}'], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "num_speculative_tokenz" in r.stderr


def test_running_plus_waiting_is_the_sequences_in_flight(server):
    """Six long requests on a server that runs two sequences at a time: while all six are in
    flight, /metrics says 2 running and 4 waiting (not the queue counted twice)."""

    async def main() -> list[tuple[float, float]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            body = {"model": MODEL, "prompt": "Count slowly:", "max_tokens": 200, "ignore_eos": True,
                    "temperature": 0, "speculative": False}
            tasks = [asyncio.create_task(client.post("/v1/completions", json=body)) for _ in range(6)]
            seen = []
            end = time.monotonic() + 60
            while time.monotonic() < end and not all(t.done() for t in tasks):
                text = (await client.get("/metrics")).text
                vals = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                        if line.startswith(("kvos:num_requests_running ", "kvos:num_requests_waiting "))}
                seen.append((vals["kvos:num_requests_running"], vals["kvos:num_requests_waiting"]))
                if seen[-1] == (2.0, 4.0):
                    break
                await asyncio.sleep(0.05)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            return seen

    seen = asyncio.run(main())
    assert all(r + w <= 6 for r, w in seen), seen
    assert seen[-1] == (2.0, 4.0), seen
