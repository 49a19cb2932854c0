"""``kvos bench serve``: streaming HTTP load on a running server; TTFT, TPOT, throughput."""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--api-key", default=None)
    p.add_argument("--model", default=None, help="model name to send (default: the server's)")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--min-prompt-words", type=int, default=16)
    p.add_argument("--max-prompt-words", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--bench-seed", type=int, default=0)
    p.add_argument("--output", default="benchmarks/results/serve-cpu.json")


def percentiles(xs: list[float]) -> dict:
    if not xs:
        return {}
    xs = sorted(xs)

    def p(q: float) -> float:
        return xs[min(len(xs) - 1, int(q * len(xs)))]

    return {"mean": sum(xs) / len(xs), "p50": p(0.5), "p90": p(0.9), "p99": p(0.99), "max": xs[-1]}


async def one(client, url: str, headers: dict, body: dict) -> dict:
    t0 = time.perf_counter()
    first, tokens, cached = None, 0, 0
    async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            return {"error": r.status_code}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
                cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
            elif chunk["choices"] and chunk["choices"][0]["text"] and first is None:
                first = time.perf_counter()
    end = time.perf_counter()
    ttft = (first or end) - t0
    return {"ttft": ttft, "e2e": end - t0, "tokens": tokens, "cached": cached,
            "tpot": (end - (first or end)) / (tokens - 1) if tokens > 1 else None}


async def load(a: argparse.Namespace) -> dict:
    import httpx

    headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    rng = random.Random(a.bench_seed)
    words = "memory block cache page token prefix share evict tier model request batch".split()
    async with httpx.AsyncClient(timeout=600) as client:
        model = a.model or (await client.get(f"{a.url}/v1/models", headers=headers)).json()["data"][0]["id"]
        bodies = [{"model": model, "stream": True, "stream_options": {"include_usage": True},
                   "temperature": 0, "ignore_eos": True, "max_tokens": a.max_tokens,
                   "prompt": " ".join(rng.choice(words) for _ in range(
                       rng.randint(a.min_prompt_words, a.max_prompt_words)))} for _ in range(a.requests)]
        sem = asyncio.Semaphore(a.concurrency)

        async def run(body):
            async with sem:
                return await one(client, a.url, headers, body)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(run(b) for b in bodies))
        wall = time.perf_counter() - t0
    ok = [r for r in results if "error" not in r]
    out_tokens = sum(r["tokens"] for r in ok)
    return {"wall_s": wall, "requests_ok": len(ok), "requests_failed": len(results) - len(ok),
            "output_tok_s": out_tokens / wall, "requests_s": len(ok) / wall,
            "ttft_s": percentiles([r["ttft"] for r in ok]),
            "tpot_s": percentiles([r["tpot"] for r in ok if r["tpot"] is not None]),
            "e2e_s": percentiles([r["e2e"] for r in ok])}


def run(a: argparse.Namespace) -> dict:
    from kvos.bench.machine import machine_info

    res = asyncio.run(load(a))
    result = {"machine": machine_info(), "url": a.url,
              "workload": {"concurrency": a.concurrency, "requests": a.requests, "max_tokens": a.max_tokens,
                           "prompt_words": [a.min_prompt_words, a.max_prompt_words]}, **res}
    result["summary"] = {"output_tok_s": round(res["output_tok_s"], 1), "requests_s": round(res["requests_s"], 2),
                         "ttft_p50_ms": round(res["ttft_s"].get("p50", 0) * 1000, 1),
                         "tpot_p50_ms": round(res["tpot_s"].get("p50", 0) * 1000, 1),
                         "failed": res["requests_failed"]}
    out = Path(a.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"saved {out}")
    return result
