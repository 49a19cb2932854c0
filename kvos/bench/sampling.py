"""``kvos bench sampling``: sampled decoding against greedy on the same requests through
``LLM.generate``, in one process (wall clock; each kind warmed up first, then the rounds
interleaved, the best round of each kept)."""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

KINDS = {
    "greedy": dict(temperature=0.0),
    "top_k50_top_p0.95": dict(temperature=0.8, top_p=0.95, top_k=50),
    "top_p0.95": dict(temperature=0.8, top_p=0.95),
    "min_p0.05": dict(temperature=0.8, min_p=0.05),
    "top_p0.95_seeded": dict(temperature=0.8, top_p=0.95, seed="per request"),
}
"""Sampling fields per kind; ``seed="per request"``: request i has seed i (what load tools send)."""


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--bench-seed", type=int, default=0)
    p.add_argument("--output", default="benchmarks/results/sampling.json")


def run(a: argparse.Namespace) -> dict:
    import random

    from kvos import LLM, SamplingParams
    from kvos.bench.machine import machine_info
    from kvos.config.flags import engine_kwargs

    kw = engine_kwargs(a)
    llm = LLM(**kw)
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(a.bench_seed)
    prompts = [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(a.input_len)]} for _ in range(a.requests)]

    def params(kind: str, max_tokens: int) -> SamplingParams | list[SamplingParams]:
        fields = dict(KINDS[kind])
        if fields.pop("seed", None) is None:
            return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **fields)
        return [SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=i, **fields) for i in range(a.requests)]

    for kind in a.kinds:  # kernels compiled, memory grown
        warm = params(kind, 8)
        llm.generate(prompts[: kw["max_num_seqs"]], warm[: kw["max_num_seqs"]] if isinstance(warm, list) else warm,
                     use_tqdm=False)
    runs: dict[str, list[float]] = {k: [] for k in a.kinds}
    for _ in range(a.rounds):
        for kind in a.kinds:
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params(kind, a.output_len), use_tqdm=False)
            runs[kind].append(time.perf_counter() - t0)
            assert all(len(o.outputs[0].token_ids) == a.output_len for o in outs)
            print(kind, round(runs[kind][-1], 2), "s", flush=True)
    best = {k: min(v) for k, v in runs.items()}
    result = {"machine": machine_info(), "engine": {k: v for k, v in kw.items()},
              "workload": {"requests": a.requests, "input_len": a.input_len, "output_len": a.output_len},
              "kinds": {k: KINDS[k] for k in a.kinds}, "seconds": runs, "best_seconds": best}
    if "greedy" in best:
        result["vs_greedy"] = {k: v / best["greedy"] for k, v in best.items()}
    result["summary"] = {k: {"best_s": round(best[k], 3), "vs_greedy": round(result.get("vs_greedy", {}).get(k, 0), 3)}
                         for k in a.kinds}
    Path(a.output).parent.mkdir(parents=True, exist_ok=True)
    Path(a.output).write_text(json.dumps(result, indent=2))
    print(json.dumps(result["summary"], indent=1))
    print(f"saved {a.output}")
    return result
