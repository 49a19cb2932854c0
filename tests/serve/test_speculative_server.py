"""Speculative decoding through `kvos serve --speculative-config` with the OpenAI client: greedy
completions equal the in-process engine's plain decoding, /metrics counts drafts and
acceptances, a request with ``"speculative": false`` proposes none, and a bad config stops the
server at start with the key named."""
from __future__ import annotations

import json
import subprocess
import sys

import openai
import pytest

from kvos import SamplingParams
from tests.engine.test_speculative import CODE, NGRAM, QUOTE
from tests.support.server import Server

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server():
    s = Server("--max-model-len", "1024", "--kv-cache-memory-bytes", str(64 << 20), "--no-warmup",
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
