"""``kvos bench serve``: streaming HTTP load on a server; TTFT, TPOT, throughput.

Two modes. ``--url``: load on a running server, prompts of random words. ``--launch ENGINE_ARGS``:
the same token-id requests first through ``LLM.generate`` (the offline baseline) and then through
``kvos serve ENGINE_ARGS --skip-tokenizer-init`` started here, from ``--client-processes``
processes of streaming clients; it reports the server's start-up time, its output tok/s as a
fraction of the offline run's, and whether every request's tokens equal the offline ones (at
temperature 0).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import queue
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
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
    p.add_argument("--launch", default=None, metavar="ENGINE_ARGS",
                   help="engine flags as one string (e.g. \"--model llama-3.1-8b --random-weights\"): run the "
                        "requests offline, then serve them from a server started with these flags (ignores --url)")
    p.add_argument("--input-len", type=int, default=256, help="--launch: prompt length in tokens (random ids)")
    p.add_argument("--client-processes", type=int, default=1,
                   help="processes sharing the streaming clients (so the load generator is not the bottleneck)")
    p.add_argument("--temperature", type=float, default=0.0)


def percentiles(xs: list[float]) -> dict:
    if not xs:
        return {}
    xs = sorted(xs)

    def p(q: float) -> float:
        return xs[min(len(xs) - 1, int(q * len(xs)))]

    return {"mean": sum(xs) / len(xs), "p50": p(0.5), "p90": p(0.9), "p99": p(0.99), "max": xs[-1]}


async def one(client, url: str, headers: dict, body: dict) -> dict:
    """One streaming completion; the first chunk with text (or token ids) marks the first token."""
    t0, sent = time.perf_counter(), time.time()
    first, tokens, cached, ids = None, 0, 0, []
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
            elif chunk["choices"]:
                choice = chunk["choices"][0]
                ids += choice.get("token_ids", ())
                if first is None and (choice["text"] or choice.get("token_ids")):
                    first = time.perf_counter()
    end = time.perf_counter()
    ttft = (first or end) - t0
    return {"ttft": ttft, "e2e": end - t0, "sent": sent, "tokens": tokens, "cached": cached, "token_ids": ids,
            "tpot": (end - (first or end)) / (tokens - 1) if tokens > 1 else None}


async def drive(url: str, headers: dict, bodies: list[dict], concurrency: int, start_at: float = 0.0) -> dict:
    """Send ``bodies`` with at most ``concurrency`` streams open, from the wall-clock time
    ``start_at`` (``time.time``) on; results in order, and the wall clock of the first send and
    the last end."""
    import httpx

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=3600, limits=limits) as client:
        sem = asyncio.Semaphore(concurrency)

        async def run(body):
            async with sem:
                return await one(client, url, headers, body)

        await asyncio.sleep(max(0.0, start_at - time.time()))
        start = time.time()
        results = await asyncio.gather(*(run(b) for b in bodies))
        return {"results": results, "start": start, "end": time.time()}


def _drive_process(args: tuple) -> dict:
    return asyncio.run(drive(*args))


START_DELAY_S = 5.0


def drive_processes(url: str, headers: dict, bodies: list[dict], concurrency: int, processes: int) -> tuple[list, float]:
    """``drive`` split across ``processes`` (request i goes to process i mod P, each with its share
    of the concurrency); results in request order, and the wall time from the first send to the
    last end. The processes start sending together, ``START_DELAY_S`` after they are spawned
    (each imports its client first): a process still starting would leave its share of the
    concurrency idle, and the wall time would count the skew."""
    if processes <= 1:
        parts = [_drive_process((url, headers, bodies, concurrency))]
    else:
        start_at = time.time() + START_DELAY_S
        shares = [(url, headers, bodies[i::processes], max(1, concurrency // processes), start_at)
                  for i in range(processes)]
        with multiprocessing.get_context("spawn").Pool(processes) as pool:
            parts = pool.map(_drive_process, shares)
    results: list = [None] * len(bodies)
    for i, part in enumerate(parts):
        results[i::max(1, processes)] = part["results"]
    skew = max(p["start"] for p in parts) - min(p["start"] for p in parts)
    if skew > 0.05:
        print(f"warning: the client processes started sending {skew:.2f} s apart", file=sys.stderr, flush=True)
    return results, max(p["end"] for p in parts) - min(p["start"] for p in parts)


def summarize(results: list[dict], wall: float) -> dict:
    ok = [r for r in results if "error" not in r]
    out_tokens = sum(r["tokens"] for r in ok)
    return {"wall_s": wall, "requests_ok": len(ok), "requests_failed": len(results) - len(ok),
            "output_tok_s": out_tokens / wall, "requests_s": len(ok) / wall,
            "ttft_s": percentiles([r["ttft"] for r in ok]),
            "tpot_s": percentiles([r["tpot"] for r in ok if r["tpot"] is not None]),
            "e2e_s": percentiles([r["e2e"] for r in ok])}


def word_bodies(a: argparse.Namespace, model: str) -> list[dict]:
    rng = random.Random(a.bench_seed)
    words = "memory block cache page token prefix share evict tier model request batch".split()
    return [{"model": model, "stream": True, "stream_options": {"include_usage": True},
             "temperature": a.temperature, "ignore_eos": True, "max_tokens": a.max_tokens,
             "prompt": " ".join(rng.choice(words) for _ in range(rng.randint(a.min_prompt_words, a.max_prompt_words)))}
            for _ in range(a.requests)]


def token_prompts(a: argparse.Namespace) -> list[list[int]]:
    """Random ids below 1,000 (inside every vocabulary): distinct prompts, no shared prefixes."""
    rng = random.Random(a.bench_seed)
    return [[rng.randrange(10, 1000) for _ in range(a.input_len)] for _ in range(a.requests)]


def _offline(engine_args: str, prompts: list[list[int]], max_tokens: int, temperature: float, out) -> None:
    """The baseline, in a process of its own: ``LLM.generate`` on the same requests (after a
    small warm-up batch, as the server warms up before reporting healthy)."""
    from kvos import LLM, SamplingParams
    from kvos.config.flags import add_engine_args, engine_kwargs

    p = argparse.ArgumentParser()
    add_engine_args(p)
    llm = LLM(**{**engine_kwargs(p.parse_known_args(shlex.split(engine_args))[0]), "skip_tokenizer_init": True})
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True,
                            seed=0 if temperature else None)
    llm.generate([{"prompt_token_ids": q} for q in prompts[:8]], params, use_tqdm=False)
    before = _step_counters(llm.engine.stats())
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": q} for q in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    steps = _step_figures(before, _step_counters(llm.engine.stats()))
    out.put({"wall_s": wall, "output_tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / wall,
             "ttft_s": percentiles([o.metrics["first_token_time"] - o.metrics["arrival_time"] for o in outs]),
             "engine_steps": steps, "token_ids": [o.outputs[0].token_ids for o in outs]})


STATS_REFRESH_S = 0.1
"""How often a busy engine's figures reach the front end (``EngineWorker.STATS_EVERY_S``)."""

_COUNTERS = {"steps": "kvos:engine_steps_total", "step_seconds": "kvos:engine_step_seconds_total",
             "batched_tokens": "kvos:engine_batched_tokens_total"}


def _step_counters(stats: dict) -> dict:
    return {k: float(stats.get(k, 0)) for k in _COUNTERS}


def _scraped_step_counters(url: str) -> dict:
    """The engines' step counters from the server's ``/metrics``."""
    import httpx

    found = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        for key, name in _COUNTERS.items():
            if line.startswith(name + " "):
                found[key] = float(line.split()[-1])
    return found


def _step_figures(before: dict, after: dict) -> dict:
    """Steps between two counter readings: how many, their mean wall time and tokens."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in _COUNTERS}
    n = max(d["steps"], 1.0)
    return {"steps": int(d["steps"]), "batched_tokens": int(d["batched_tokens"]), "mean_step_ms": 1000 * d["step_seconds"] / n,
            "mean_tokens_per_step": d["batched_tokens"] / n}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launched(a: argparse.Namespace) -> dict:
    """Offline baseline, then the same requests through a server started here."""
    prompts = token_prompts(a)
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_offline, args=(a.launch, prompts, a.max_tokens, a.temperature, q))
    proc.start()
    while True:
        try:
            offline = q.get(timeout=1)
            break
        except queue.Empty:
            if not proc.is_alive():
                raise RuntimeError(f"the offline run failed (exit code {proc.exitcode}); see its traceback above")
    proc.join()
    print(f"offline: {offline['output_tok_s']:.0f} output tok/s; starting the server", file=sys.stderr, flush=True)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "kvos.cli", "serve", "--port", str(port), "--skip-tokenizer-init",
           "--max-waiting-requests", str(max(256, 2 * a.concurrency)), *shlex.split(a.launch)]
    log = tempfile.NamedTemporaryFile("w+", prefix="kvos-bench-serve-", suffix=".log", delete=False)
    t0 = time.perf_counter()
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                              env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    try:
        while not _healthy(url):
            if server.poll() is not None or time.perf_counter() - t0 > 900:
                raise RuntimeError(f"kvos serve exited ({server.returncode}) or was not healthy in 900 s: {shlex.join(cmd)}\n"
                                   f"{Path(log.name).read_text()[-3000:]}")
            time.sleep(0.2)
        startup = time.perf_counter() - t0
        print(f"server healthy after {startup:.1f} s; sending the requests", file=sys.stderr, flush=True)
        seed = {"seed": 0} if a.temperature else {}
        bodies = [{"prompt": q, "stream": True, "stream_options": {"include_usage": True}, **seed,
                   "temperature": a.temperature, "ignore_eos": True, "max_tokens": a.max_tokens} for q in prompts]
        drive_processes(url, {}, bodies[:8], 8, 1)  # the same warm-up as offline
        time.sleep(2 * STATS_REFRESH_S)
        before = _scraped_step_counters(url)
        results, wall = drive_processes(url, {}, bodies, a.concurrency, a.client_processes)
        time.sleep(2 * STATS_REFRESH_S)
        steps = _step_figures(before, _scraped_step_counters(url))
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
    t_first = min(r["sent"] for r in results if "sent" in r)  # per request: sent (s after the first), TTFT, e2e
    http = {**summarize(results, wall), "engine_steps": steps,
            "requests": [[round(r["sent"] - t_first, 3), round(r["ttft"], 3), round(r["e2e"], 3)]
                         for r in results if "sent" in r]}
    phases = [line.split(": ", 2)[-1] for line in Path(log.name).read_text().splitlines()
              if "start-up:" in line or "warm-up done" in line]
    same = sum(r.get("token_ids") == ids for r, ids in zip(results, offline["token_ids"]))
    return {"startup_s": startup, "startup_phases": phases, "offline": {k: v for k, v in offline.items() if k != "token_ids"}, "http": http,
            "http_over_offline": http["output_tok_s"] / offline["output_tok_s"], "identical_outputs": same}


def _healthy(url: str) -> bool:
    import httpx

    try:
        return httpx.get(f"{url}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def run(a: argparse.Namespace) -> dict:
    from kvos.bench.machine import machine_info

    workload = {"concurrency": a.concurrency, "requests": a.requests, "max_tokens": a.max_tokens,
                "temperature": a.temperature, "client_processes": a.client_processes}
    if a.launch is not None:
        res = launched(a)
        result = {"machine": machine_info(), "launch": a.launch, "workload": {**workload, "input_len": a.input_len},
                  **res}
        result["summary"] = {"startup_s": round(res["startup_s"], 1),
                             "offline_output_tok_s": round(res["offline"]["output_tok_s"], 1),
                             "http_output_tok_s": round(res["http"]["output_tok_s"], 1),
                             "http_over_offline": round(res["http_over_offline"], 3),
                             "identical_outputs": f"{res['identical_outputs']}/{a.requests}",
                             "ttft_p50_ms": round(res["http"]["ttft_s"].get("p50", 0) * 1000, 1),
                             "ttft_p90_ms": round(res["http"]["ttft_s"].get("p90", 0) * 1000, 1),
                             "tpot_p50_ms": round(res["http"]["tpot_s"].get("p50", 0) * 1000, 1),
                             "tpot_p90_ms": round(res["http"]["tpot_s"].get("p90", 0) * 1000, 1),
                             "offline_ttft_p50_ms": round(res["offline"]["ttft_s"].get("p50", 0) * 1000, 1),
                             "offline_steps": res["offline"]["engine_steps"],
                             "http_steps": res["http"]["engine_steps"],
                             "failed": res["http"]["requests_failed"]}
        return _save(a, result)
    import httpx

    headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    model = a.model or httpx.get(f"{a.url}/v1/models", headers=headers).json()["data"][0]["id"]
    results, wall = drive_processes(a.url, headers, word_bodies(a, model), a.concurrency, a.client_processes)
    res = summarize(results, wall)
    result = {"machine": machine_info(), "url": a.url,
              "workload": {**workload, "prompt_words": [a.min_prompt_words, a.max_prompt_words]}, **res}
    result["summary"] = {"output_tok_s": round(res["output_tok_s"], 1), "requests_s": round(res["requests_s"], 2),
                         "ttft_p50_ms": round(res["ttft_s"].get("p50", 0) * 1000, 1),
                         "tpot_p50_ms": round(res["tpot_s"].get("p50", 0) * 1000, 1),
                         "failed": res["requests_failed"]}
    return _save(a, result)


def _save(a: argparse.Namespace, result: dict) -> dict:
    out = Path(a.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"saved {out}")
    return result
