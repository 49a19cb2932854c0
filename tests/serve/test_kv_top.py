"""``GET /v1/kv/summary`` and ``kvos top`` against a real server: a pool of 64 pages of 8 tokens
(63 usable; page 0 holds the null block), no warm-up, an API key, prompts as token ids so that
every figure follows from the blocks the requests share."""
from __future__ import annotations

import io
import os
import random
import subprocess
import sys

import httpx
import pytest
from rich.console import Console

from kvos.serve.top import run
from tests.support.server import Server, free_port

MODEL = "SmolLM2-135M-Instruct"
BLOCK = 8
USABLE = 63
KEY = "top-secret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server():
    s = Server("--max-model-len", "256", "--num-blocks", str(USABLE + 1), "--block-size", str(BLOCK), "--no-warmup",
               "--api-key", KEY).wait_ready()
    yield s
    s.stop()


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(n)]


def complete(server: Server, prompt: list[int]) -> dict:
    r = httpx.post(f"{server.url}/v1/completions", headers=AUTH, timeout=120,
                   json={"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def summary(server) -> dict:
    """Three prompts of 44 tokens sharing a 4-block prefix; the last two also share a fifth
    block: the prefix is hit twice (32 tokens), the 5-block chain once (40 tokens)."""
    shared, a, b = tokens(1, 4 * BLOCK), tokens(2, 12), tokens(3, 12)
    cached = [complete(server, p)["usage"]["prompt_tokens_details"]["cached_tokens"]
              for p in (shared + a, shared + b, shared + b)]
    assert cached == [0, 4 * BLOCK, 5 * BLOCK]
    r = httpx.get(f"{server.url}/v1/kv/summary", headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def test_summary_needs_the_key_and_bounds_top(server):
    assert httpx.get(f"{server.url}/v1/kv/summary", timeout=30).status_code == 401
    assert httpx.get(f"{server.url}/v1/kv/summary", params={"top": 101}, headers=AUTH, timeout=30).status_code == 400
    assert httpx.get(f"{server.url}/v1/kv/summary", params={"top": 0}, headers=AUTH,
                     timeout=30).json()["top_prefixes"] == []


def test_summary_pages_add_up_and_the_shared_prefix_leads(server, summary):
    s = summary
    assert s["object"] == "kv.summary" and s["block_size"] == BLOCK and s["kv_layout"] == "unified"
    pages, [group] = s["pages"], s["groups"]
    assert pages["total"] == USABLE == pages["free"] + pages["cached"] + pages["used"]
    assert pages["free"] + group["pages"] == USABLE  # every page is free or held by the group
    assert group["total"] == group["free"] + group["cached"] + group["used"] == group["pages"]
    assert group["kind"] == "full_attention" and group["block_size"] == BLOCK and group["block_bytes"] > 0
    # 3 prompts of 44 tokens, 5 full blocks each: the 4 shared, one of a, one of b; all cached, none used
    assert (pages["used"], pages["cached"]) == (0, 4 + 1 + 1)
    assert pages["bytes"]["cached"] == pages["cached"] * pages["page_bytes"] > 0
    hr = s["hit_rate"]
    assert (hr["queries_tokens"], hr["hits_tokens"], hr["device_hits_tokens"], hr["tier_hits_tokens"]) == (
        3 * 44, 32 + 40, 72, 0)
    assert hr["prefix"] == pytest.approx(72 / 132)
    assert s["requests"] == {"running": 0, "waiting": 0, "loading": 0}
    assert s["tiers"] == []
    [engine] = s["engines"]
    assert engine["up"] and engine["pid"] == server.proc.pid and engine["pages"]["total"] == USABLE and engine["hit_rate"]["hits_tokens"] == 72
    top = s["top_prefixes"]
    assert [(p["rank"], p["hits"], p["tokens"], p["group"], p["engine"], p["state"]) for p in top] == [
        (1, 2, 4 * BLOCK, 0, 0, "cached"), (2, 1, 5 * BLOCK, 0, 0, "cached")]
    assert all(len(p["id"]) == 12 and int(p["id"], 16) >= 0 for p in top) and top[0]["id"] != top[1]["id"]
    assert "hash" not in top[0]  # an opaque id only: no block hash a client could compute from a prompt


def test_kvos_top_once_renders_the_summary(server, summary):
    env = {**os.environ, "COLUMNS": "150", "KVOS_API_KEY": KEY}
    out = subprocess.run([sys.executable, "-m", "kvos.cli", "top", "--once", "--url", server.url,
                          "--interval", "0.2"], capture_output=True, text=True, env=env, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    for section in ("kvos top", "KV pages by group and state", "Hit rates (prompt tokens)",
                    "Requests and throughput", "Top cached prefixes by hits", "Engines"):
        assert section in text, text
    assert "Tiers below the device" not in text  # no tier configured
    pool = next(line for line in text.splitlines() if "pool (pages)" in line)
    assert [c.strip() for c in pool.split("│")[5:9]] == [str(USABLE), "0", "6", str(USABLE - 6)], pool
    assert "full_attention" in text and "8 tok" in text
    assert "54.5%" in text  # prefix hit rate 72 / 132
    top = summary["top_prefixes"]
    rows = {line.split("│")[1].strip(): line for line in text.splitlines() if top[0]["id"] in line
            or top[1]["id"] in line}
    assert len(rows) == 2, text
    for p in top:
        line = next(v for v in rows.values() if p["id"] in v)
        cells = [c.strip() for c in line.split("│")[1:-1]]
        assert cells[:6] == [str(p["rank"]), str(p["hits"]), str(p["tokens"]), "0", "0", "cached"], line


def test_kvos_top_reports_an_unreachable_server(capsys):
    console = Console(record=True, width=120, file=io.StringIO())
    assert run(f"http://127.0.0.1:{free_port()}", None, 0.1, once=True, console=console) == 1
    assert "cannot read" in capsys.readouterr().err
