"""``kvos bench images``: a vision-language model (random weights at a real size, e.g. ``--model
gemma-3-12b --random-weights`` on a GPU) on image workloads.

- **Encoder**: one batch of ``--encoder-batch`` images through the SigLIP tower and projector,
  timed alone (median of runs), against ``FLOPs / peak`` (patch embedding, layers, attention).
- **Shared images**: ``--requests`` requests, each a text of its own (``--prefix-tokens``), one of
  ``--images`` distinct images, then a question (``--question-tokens``), answered with
  ``--answer-tokens``; one request at a time, so each TTFT is a prefill alone. The text before the
  image differs, so the image's KV never hits; only the encoder cache can save its encoding. Mean
  TTFT and encoder runs with the encoder cache on (``encoder_cache_mb``) and off (0).
- **Later turns**: ``--conversations`` chats whose first turn holds an image; the second turn (the
  first, its answer, a new question) with prefix caching on (the image's KV hits: no encoder, no
  prefill of it) vs off.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--encoder-batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--images", type=int, default=8, help="distinct images among the requests")
    p.add_argument("--prefix-tokens", type=int, default=32)
    p.add_argument("--question-tokens", type=int, default=32)
    p.add_argument("--answer-tokens", type=int, default=16)
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--output", default="benchmarks/results/images.json")


def _image(i: int, size: int):
    import numpy as np

    from kvos.engine.media import PreparedImage

    pixels = np.random.default_rng(i).uniform(-1, 1, (1, 3, size, size)).astype(np.float32)
    return PreparedImage(f"bench-image-{i}", pixels)


def _text(rng: random.Random, n: int, vocab: int) -> list[int]:
    """Random text ids, clear of the special tokens (Gemma 3's image and turn tokens lie above 255,000)."""
    return [rng.randrange(10, min(vocab, 255_000)) for _ in range(n)]


def _prompt(v, prefix: list[int], question: list[int]) -> list[int]:
    return [2, *prefix, v.boi_token_id, *([v.image_token_id] * v.tokens_per_image), v.eoi_token_id, *question]


def _run_one(llm, ids: list[int], image, max_tokens: int):
    from kvos import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": [image]}}, sp, use_tqdm=False)[0]
    m = out.metrics
    return out, m["first_token_time"] - m["arrival_time"]


def shared_images(llm, a: argparse.Namespace, size: int) -> dict:
    v, vocab = llm.engine.model_config.vision, llm.engine.model_config.vocab_size
    rng = random.Random(1)
    images = [_image(i, size) for i in range(a.images)]
    before = llm.stats()["encoder"]["encoder_runs"]
    ttfts = []
    t0 = time.perf_counter()
    for r in range(a.requests):
        ids = _prompt(v, _text(rng, a.prefix_tokens, vocab), _text(rng, a.question_tokens, vocab))
        _, ttft = _run_one(llm, ids, images[r % a.images], a.answer_tokens)
        ttfts.append(ttft)
    wall = time.perf_counter() - t0
    return {"mean_ttft_s": statistics.mean(ttfts), "p50_ttft_s": statistics.median(ttfts),
            "encoder_runs": llm.stats()["encoder"]["encoder_runs"] - before, "wall_s": wall,
            "requests": a.requests}


def later_turns(llm, a: argparse.Namespace, size: int) -> dict:
    v, vocab = llm.engine.model_config.vision, llm.engine.model_config.vocab_size
    rng = random.Random(2)
    ttfts, cached, prompt = [], 0, 0
    for c in range(a.conversations):
        image = _image(1000 + c, size)
        first = _prompt(v, _text(rng, a.prefix_tokens, vocab), _text(rng, a.question_tokens, vocab))
        out, _ = _run_one(llm, first, image, a.answer_tokens)
        second = first + list(out.outputs[0].token_ids) + _text(rng, a.question_tokens, vocab)
        out2, ttft = _run_one(llm, second, image, a.answer_tokens)
        ttfts.append(ttft)
        cached += out2.num_cached_tokens
        prompt += len(second)
    return {"second_turn_mean_ttft_s": statistics.mean(ttfts), "cached_token_share": cached / prompt}


def encoder_timing(llm, batch: int, size: int, peak_flops: float | None) -> dict:
    import numpy as np
    import torch

    from kvos.sim.cost_model import encoder_flops

    eng = llm.engine
    v, model = eng.model_config.vision, eng.runner.model
    pixels = torch.from_numpy(np.stack([_image(i, size).tiles[0] for i in range(batch)])).to(eng.runner.device)
    sync = torch.cuda.synchronize if eng.runner.device.type == "cuda" else (lambda: None)
    times = []
    with torch.inference_mode():
        for _ in range(6):
            sync()
            t0 = time.perf_counter()
            model.encode_images(pixels)
            sync()
            times.append(time.perf_counter() - t0)
    seconds = statistics.median(times[1:])
    flops = batch * encoder_flops(v, eng.model_config.hidden_size)
    row = {"batch": batch, "seconds": seconds, "ms_per_image": 1e3 * seconds / batch, "flops": flops}
    if peak_flops:
        row["roofline_s"] = flops / peak_flops
        row["fraction_of_roofline"] = row["roofline_s"] / seconds
    return row


def run(a: argparse.Namespace) -> dict:
    import gc

    import torch

    from kvos import LLM
    from kvos.bench.machine import machine_info
    from kvos.config.flags import engine_kwargs

    kw = engine_kwargs(a)
    llm = LLM(**kw)
    mc = llm.engine.model_config
    if mc.vision is None:
        raise ValueError(f"model: {kw['model']} is not a vision-language model")
    size = mc.vision.image_size
    peak = None
    if torch.cuda.is_available():
        from kvos.bench.roofline import measure_ceilings

        peak = measure_ceilings()["bf16_gemm_TFLOPs"] * 1e12
    out = Path(a.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    result: dict = {"machine": machine_info(), "engine": dict(kw), "vision": vars(mc.vision) if hasattr(
        mc.vision, "__dict__") else str(mc.vision), "encoder": [encoder_timing(llm, b, size, peak)
                                                               for b in a.encoder_batch]}
    print("encoder", json.dumps(result["encoder"]), flush=True)
    _run_one(llm, _prompt(mc.vision, [5] * 8, [6] * 8), _image(99, size), 2)  # warm-up
    result["shared_images"] = {"encoder_cache": shared_images(llm, a, size)}
    llm.reset_prefix_cache()
    result["later_turns"] = {"prefix_caching": later_turns(llm, a, size)}
    del llm
    gc.collect()
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    off = LLM(**{**kw, "encoder_cache_mb": 0, "enable_prefix_caching": False})
    _run_one(off, _prompt(mc.vision, [5] * 8, [6] * 8), _image(99, size), 2)
    result["shared_images"]["no_encoder_cache"] = shared_images(off, a, size)
    result["later_turns"]["no_prefix_caching"] = later_turns(off, a, size)
    s, lt = result["shared_images"], result["later_turns"]
    result["summary"] = {
        "encoder_ms_per_image": {r["batch"]: round(r["ms_per_image"], 2) for r in result["encoder"]},
        "shared_images_ttft_speedup": round(s["no_encoder_cache"]["mean_ttft_s"] / s["encoder_cache"]["mean_ttft_s"], 2),
        "shared_images_encoder_runs": [s["encoder_cache"]["encoder_runs"], s["no_encoder_cache"]["encoder_runs"]],
        "second_turn_ttft_speedup": round(lt["no_prefix_caching"]["second_turn_mean_ttft_s"]
                                          / lt["prefix_caching"]["second_turn_mean_ttft_s"], 2)}
    print("summary", json.dumps(result["summary"]), flush=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"saved {out}")
    return result
