"""``kvos bench tensor-parallel``: one engine sharded over ``--tensor-parallel-size`` GPUs (e.g.
``--model llama-3.1-70b --random-weights --tensor-parallel-size 2``): decode steps against their
roofline, and a 1,000-request throughput run.

- **All-reduce**: the median time of one all-reduce of ``[batch, hidden]`` in the model's dtype,
  measured on the engine's own process group in the same run (NCCL).
- **Decode**: ``--batch`` requests of ``--context`` tokens decode ``--decode-tokens`` tokens; the
  step time is (whole run - the same run with one output token) / (steps - 1). Its roofline per
  GPU: the rank's weights and its K/V heads' context read once over the GPU's measured copy
  bandwidth (``kvos.bench.roofline``), plus ``2 x layers + 1`` all-reduces (after each
  ``o_proj`` and ``down_proj``, and the vocabulary-parallel embedding) at the measured time.
- **Throughput**: ``--requests`` x ``--prompt``/``--output`` tokens submitted at once.
"""
from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--requests", type=int, default=1000, help="throughput run: requests at once (0: skip)")
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--output-tokens", type=int, default=256)
    p.add_argument("--output", default="benchmarks/results/tensor_parallel.json")


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def _timed(llm, prompts: list[list[int]], max_tokens: int) -> float:
    from kvos import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return time.perf_counter() - t0


def run(a: argparse.Namespace) -> dict:
    import torch

    from kvos import LLM
    from kvos.bench.machine import machine_info
    from kvos.bench.roofline import ModelCost, measure_ceilings
    from kvos.config.flags import engine_kwargs

    if not torch.cuda.is_available():
        raise ValueError("kvos bench tensor-parallel measures against a GPU's roofline: no GPU here")
    kw = engine_kwargs(a)
    kw["max_num_seqs"] = max(kw["max_num_seqs"], *a.batch)
    ceilings = measure_ceilings()  # before the engine: the copy needs 2 GiB of free memory
    torch.cuda.empty_cache()
    t0 = time.perf_counter()
    llm = LLM(**kw)
    eng = llm.engine
    runner, mc = eng.runner, eng.model_config
    tp = kw.get("tensor_parallel_size", 1)
    cost = ModelCost.of(runner.model, runner.dtype.itemsize, eng.layout)  # this rank's shard and K/V heads
    bandwidth = ceilings["hbm_GBps"] * 1e9
    result: dict = {"machine": machine_info(), "engine": dict(kw), "tensor_parallel_size": tp,
                    "startup_s": time.perf_counter() - t0, "ceilings": ceilings,
                    "weight_bytes_per_gpu": cost.weight_bytes, "kv_bytes_per_token_per_gpu": cost.kv_bytes_per_token,
                    "kv_pool_pages": eng.kv.pages.num_pages, "all_reduce_s": {}, "decode": []}
    out = Path(a.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    vocab = mc.vocab_size
    _timed(llm, _prompts(2, 64, vocab, 0), 4)  # warm-up
    reduces = 2 * mc.num_layers + 1
    for batch in a.batch:
        ar = runner.time_all_reduce(batch) if tp > 1 else 0.0
        result["all_reduce_s"][batch] = ar
        prompts = _prompts(batch, a.context, vocab, batch)
        llm.reset_prefix_cache()
        t1 = _timed(llm, prompts, 1)
        llm.reset_prefix_cache()
        tn = _timed(llm, prompts, a.decode_tokens)
        step = (tn - t1) / (a.decode_tokens - 1)
        mid = a.context + a.decode_tokens // 2
        memory = (cost.weight_bytes + batch * mid * cost.kv_bytes_per_token) / bandwidth
        floor = memory + reduces * ar
        row = {"batch": batch, "context": a.context, "step_s": step, "roofline_step_s": floor,
               "memory_s": memory, "all_reduce_total_s": reduces * ar, "fraction_of_roofline": floor / step,
               "output_tok_s": batch / step}
        result["decode"].append(row)
        print("decode", json.dumps(row), flush=True)
        out.write_text(json.dumps(result, indent=2))
    if a.requests:
        llm.reset_prefix_cache()
        prompts = _prompts(a.requests, a.prompt, vocab, 11)
        t = _timed(llm, prompts, a.output_tokens)
        result["throughput"] = {"requests": a.requests, "prompt": a.prompt, "output": a.output_tokens,
                                "seconds": t, "output_tok_s": a.requests * a.output_tokens / t}
        print("throughput", json.dumps(result["throughput"]), flush=True)
    result["summary"] = {
        "decode_fraction_of_roofline": {r["batch"]: round(r["fraction_of_roofline"], 3) for r in result["decode"]},
        "decode_tok_s": {r["batch"]: round(r["output_tok_s"], 1) for r in result["decode"]},
        "throughput_tok_s": round(result["throughput"]["output_tok_s"], 1) if "throughput" in result else None}
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result["summary"]))
    print(f"saved {out}")
    llm.shutdown()
    return result
