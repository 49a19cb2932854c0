"""``kvos bench structured``: decoding with structured outputs against free decoding on the same
requests through ``LLM.generate`` (wall clock, one process; each kind warmed up, rounds
interleaved, the best round of each kept). Constrained rows follow a regex (lowercase words) that
only a NUL byte ends and EOS is ignored, so rows decode ``--output-len`` tokens in every kind
(the figure is tokens per second, should a row ever sample the NUL)."""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

KINDS = {"free": 0.0, "quarter": 0.25, "half": 0.5, "all": 1.0}
"""The share of the batch's rows that are constrained."""
PATTERN = "[a-z ]+\\x00"


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--bench-seed", type=int, default=0)
    p.add_argument("--output", default="benchmarks/results/structured.json")


def run(a: argparse.Namespace) -> dict:
    import random

    from kvos import LLM, SamplingParams
    from kvos.bench.machine import machine_info
    from kvos.config.flags import engine_kwargs
    from kvos.core.structured_outputs import StructuredOutputsParams

    kw = engine_kwargs(a)
    llm = LLM(**kw)
    vocab = len(llm.get_tokenizer())
    rng = random.Random(a.bench_seed)
    prompts = [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(a.input_len)]} for _ in range(a.requests)]
    regex = StructuredOutputsParams(regex=PATTERN)

    def params(kind: str, max_tokens: int) -> list:
        every = round(1 / KINDS[kind]) if KINDS[kind] else 0
        return [SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.8,
                               structured_outputs=regex if every and i % every == 0 else None)
                for i in range(len(prompts))]

    for kind in a.kinds:  # kernels compiled, grammar cached, memory grown
        llm.generate(prompts[: kw["max_num_seqs"]], params(kind, 8)[: kw["max_num_seqs"]], use_tqdm=False)
    runs: dict[str, list[float]] = {k: [] for k in a.kinds}
    tokens: dict[str, int] = {}
    for _ in range(a.rounds):
        for kind in a.kinds:
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params(kind, a.output_len), use_tqdm=False)
            runs[kind].append(time.perf_counter() - t0)
            tokens[kind] = sum(len(o.outputs[0].token_ids) for o in outs)
            print(kind, round(runs[kind][-1], 2), "s", tokens[kind], "tokens", flush=True)
    best = {k: min(v) for k, v in runs.items()}
    tok_s = {k: tokens[k] / best[k] for k in a.kinds}
    result = {"machine": machine_info(), "engine": dict(kw),
              "workload": {"requests": a.requests, "input_len": a.input_len, "output_len": a.output_len,
                           "regex": PATTERN},
              "kinds": KINDS, "seconds": runs, "best_seconds": best, "output_tokens": tokens, "tok_s": tok_s}
    if "free" in best:
        result["cost_vs_free"] = {k: tok_s["free"] / v - 1 for k, v in tok_s.items()}
    result["summary"] = {k: {"constrained_share": KINDS[k], "best_s": round(best[k], 3), "tok_s": round(tok_s[k]),
                             "cost_vs_free": round(result.get("cost_vs_free", {}).get(k, 0), 3)} for k in a.kinds}
    Path(a.output).parent.mkdir(parents=True, exist_ok=True)
    Path(a.output).write_text(json.dumps(result, indent=2))
    print(json.dumps(result["summary"], indent=1))
    print(f"saved {a.output}")
    return result
