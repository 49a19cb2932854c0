"""``kvos bench image-goodput``: encoder engines (E/PD) against engines that encode their own
images, on an image-heavy workload: every request brings ``--images-per-request`` new images
(random pixels at the model's size, so no cache helps), a short text and a short answer, at
Poisson arrival ``--rates``. Each setup (``--setups``: ``N`` language engines, ``N+E``: and E
encoder engines; local processes, one GPU each while GPUs last) runs every rate; per rate: the
share of requests meeting both SLOs (TTFT from submission at the front end, so encoding on an
encoder engine counts; mean time per output token after the first), throughput, TTFT and TPOT
percentiles. Goodput: the highest rate whose SLO attainment is at least ``--attainment``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--setups", nargs="+", default=["1", "1+1"],
                   help="language engines, plus encoder engines after a '+': 1 (one engine encodes its own), 1+1")
    p.add_argument("--rates", type=float, nargs="+", default=[2, 4, 6, 8, 10, 12, 14, 16])
    p.add_argument("--requests", type=int, default=80, help="requests per rate")
    p.add_argument("--images-per-request", type=int, default=2)
    p.add_argument("--text-tokens", type=int, default=64)
    p.add_argument("--answer-tokens", type=int, default=32)
    p.add_argument("--ttft-slo", type=float, default=0.5, help="seconds")
    p.add_argument("--tpot-slo", type=float, default=0.05, help="seconds per output token after the first")
    p.add_argument("--attainment", type=float, default=0.9)
    p.add_argument("--output", default="benchmarks/results/image-goodput.json")


def _setup(text: str) -> tuple[int, int]:
    lang, _, enc = text.partition("+")
    return int(lang), int(enc or 0)


def _prompt(v, rng: random.Random, a: argparse.Namespace, vocab: int) -> list[int]:
    """Gemma 3's layout: text, then each image's start token, image tokens and end token."""
    ids = [2] + [rng.randrange(10, min(vocab, 255_000)) for _ in range(a.text_tokens)]
    for _ in range(a.images_per_request):
        ids += [v.boi_token_id, *([v.image_token_id] * v.tokens_per_image), v.eoi_token_id]
    return ids


def _images(v, rng: random.Random, n: int) -> list:
    import numpy as np

    from kvos.engine.media import PreparedImage

    s = v.image_size
    return [PreparedImage(f"goodput-{rng.getrandbits(64):x}",
                          np.random.default_rng(rng.getrandbits(32)).uniform(-1, 1, (1, 3, s, s)).astype(np.float32))
            for _ in range(n)]


async def _one(engine, ids: list[int], images: list, a: argparse.Namespace, rid: str) -> dict:
    from kvos import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=a.answer_tokens, ignore_eos=True)
    t0 = time.monotonic()
    stream = await engine.submit({"prompt_token_ids": ids, "multi_modal_data": {"image": images}}, sp, rid)
    first = None
    async for out in stream:
        if first is None and out.outputs[0].token_ids:
            first = time.monotonic()
    end = time.monotonic()
    n = len(stream.last.outputs[0].token_ids)
    ttft = (first or end) - t0
    tpot = (end - (first or end)) / max(1, n - 1)
    return {"ttft": ttft, "tpot": tpot, "ok": ttft <= a.ttft_slo and tpot <= a.tpot_slo, "end": end, "start": t0}


async def _rate(engine, v, vocab: int, rate: float, a: argparse.Namespace, seed: int) -> dict:
    rng = random.Random(seed)
    work = [(_prompt(v, rng, a, vocab), _images(v, rng, a.images_per_request)) for _ in range(a.requests)]
    tasks, t = [], time.monotonic()
    begin = t
    for i, (ids, images) in enumerate(work):
        t += rng.expovariate(rate)
        await asyncio.sleep(max(0.0, t - time.monotonic()))
        tasks.append(asyncio.create_task(_one(engine, ids, images, a, f"g{seed}-{i}")))
    rows = await asyncio.gather(*tasks)
    wall = max(r["end"] for r in rows) - begin
    ttfts, tpots = sorted(r["ttft"] for r in rows), sorted(r["tpot"] for r in rows)

    def pct(xs, q):
        return xs[min(len(xs) - 1, int(q * len(xs)))]

    return {"rate": rate, "attainment": sum(r["ok"] for r in rows) / len(rows), "throughput_rps": len(rows) / wall,
            "ttft_p50_s": statistics.median(ttfts), "ttft_p90_s": pct(ttfts, 0.9),
            "tpot_p50_s": statistics.median(tpots), "tpot_p90_s": pct(tpots, 0.9)}


async def _run_setup(kw: dict, lang: int, enc: int, a: argparse.Namespace) -> dict:
    from kvos.distributed.dp_engine import DataParallelEngine

    engine = DataParallelEngine(kw, lang, "kv_aware", transport="process", encoder_engines=enc,
                                engine_timeout_s=600.0)
    engine.start()
    try:
        v, vocab = engine.info.vision, engine.info.vocab_size
        if v is None:
            raise ValueError(f"model: {kw['model']} is not a vision-language model")
        warm = argparse.Namespace(**{**vars(a), "requests": 6})
        await _rate(engine, v, vocab, 2.0, warm, seed=999)  # graphs, allocator, the encoder's first batches
        rows = []
        for i, rate in enumerate(a.rates):
            row = await _rate(engine, v, vocab, rate, a, seed=i)
            print(f"{lang}+{enc}", json.dumps(row), flush=True)
            rows.append(row)
        stats = engine.stats()
    finally:
        await engine.stop_polling()
        engine.shutdown()
    ok = [r["rate"] for r in rows if r["attainment"] >= a.attainment]
    return {"language_engines": lang, "encoder_engines": enc, "rates": rows, "goodput_rps": max(ok, default=0.0),
            "encoder": stats.get("encoder"), "encoder_engines_stats": stats.get("encoder_engines")}


def run(a: argparse.Namespace) -> dict:
    from kvos.bench.machine import machine_info
    from kvos.config.flags import engine_kwargs

    kw = engine_kwargs(a)
    out = Path(a.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = json.loads(out.read_text()) if out.exists() else {}
    result.update({"machine": machine_info(), "engine": dict(kw),
                   "workload": {k: getattr(a, k) for k in ("images_per_request", "text_tokens", "answer_tokens",
                                                            "requests", "ttft_slo", "tpot_slo", "attainment")}})
    setups = result.setdefault("setups", {})
    for text in a.setups:
        lang, enc = _setup(text)
        setups[f"{lang}+{enc}"] = asyncio.run(_run_setup(kw, lang, enc, a))
        out.write_text(json.dumps(result, indent=2))
    result["summary"] = {k: {"goodput_rps": s["goodput_rps"], "gpus": s["language_engines"] + s["encoder_engines"]}
                         for k, s in setups.items()}
    print("summary", json.dumps(result["summary"]), flush=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"saved {out}")
    return result
