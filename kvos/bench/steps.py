"""``kvos bench steps``: time real engine steps, for ``kvos simulate --calibration``."""
from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--min-prompt", type=int, default=16)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--bench-seed", type=int, default=0)
    p.add_argument("--output", default="benchmarks/results/steps-cpu.json")


def measure(llm, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    """Run ``prompts`` and return one record per step: tokens computed, context read, query-key
    pairs, wall seconds."""
    from kvos import SamplingParams

    eng = llm.engine
    shape: dict = {}

    def hook(out) -> None:
        shape.update(num_tokens=0, context_tokens=0, attn_pairs=0)
        for s in out.seqs:
            end = s.start + s.num_new_tokens
            shape["num_tokens"] += s.num_new_tokens
            shape["context_tokens"] += end
            shape["attn_pairs"] += s.num_new_tokens * (s.start + end + 1) // 2

    eng.schedule_hook = hook
    for p in prompts:
        eng.add_request({"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    steps = []
    try:
        while eng.has_unfinished_requests():
            t0 = time.perf_counter()
            eng.step()
            steps.append({**shape, "seconds": time.perf_counter() - t0})
    finally:
        eng.schedule_hook = None
    return steps


def run(a: argparse.Namespace) -> dict:
    from kvos import LLM
    from kvos.bench.machine import machine_info
    from kvos.config.flags import engine_kwargs

    llm = LLM(**engine_kwargs(a))
    rng = random.Random(a.bench_seed)
    vocab = llm.engine.model_config.vocab_size
    prompts = [[rng.randrange(100, vocab) for _ in range(rng.randint(a.min_prompt, a.max_prompt))]
               for _ in range(a.num_requests)]
    steps = measure(llm, prompts, a.max_tokens)
    result = {"machine": machine_info(), "model": str(llm.engine.model_path), "steps": steps}
    result["summary"] = {"steps": len(steps), "mean_step_ms": round(1000 * sum(s["seconds"] for s in steps) / len(steps), 2)}
    Path(a.output).parent.mkdir(parents=True, exist_ok=True)
    Path(a.output).write_text(json.dumps(result, indent=2))
    print(f"saved {a.output}")
    return result
