"""Segment reuse on a GPU: TTFT of RAG-shaped prompts with their documents cached, against full
prefill, on a random-weight model shape (speed only: random weights say nothing of quality, which
``kvos bench segments`` measures on real models). Also checks that ``segment_recompute=1`` gives
full prefill's greedy tokens.

    python benchmarks/scripts/segments_gpu_ttft.py --model llama-3.1-8b --out benchmarks/results/segments-gpu.json
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import time

import torch

from kvos import LLM, SamplingParams
from kvos.bench.machine import machine_info


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--shares", nargs="+", type=float, default=[0.0, 0.15, 0.3, 1.0])
    p.add_argument("--num-docs", type=int, default=8)
    p.add_argument("--doc-tokens", type=int, default=2000)
    p.add_argument("--docs-per-prompt", type=int, default=4)
    p.add_argument("--num-prompts", type=int, default=12)
    p.add_argument("--out", default="benchmarks/results/segments-gpu.json")
    a = p.parse_args()
    rng = random.Random(0)
    instr = [rng.randrange(1000, 30000) for _ in range(100)]
    docs = [[rng.randrange(1000, 30000) for _ in range(a.doc_tokens)] for _ in range(a.num_docs)]
    prompts = []
    for _ in range(a.num_prompts):
        chosen = rng.sample(range(a.num_docs), a.docs_per_prompt)
        prompts.append([instr, *(docs[c] for c in chosen), [rng.randrange(1000, 30000) for _ in range(50)]])
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    one = SamplingParams(temperature=0, max_tokens=1)

    def run(**kw) -> dict:
        llm = LLM(model=a.model, random_weights=True, device="cuda", skip_tokenizer_init=True,
                  max_num_batched_tokens=16384, **kw)
        llm.generate([{"segments": [instr, d, [7]]} for d in docs], one, use_tqdm=False)  # documents cached
        llm.generate([{"segments": prompts[0]}], greedy, use_tqdm=False)  # warm-up of this prompt shape
        ttft, tokens = [], []
        for segs in prompts[1:]:
            torch.cuda.synchronize()
            out = llm.generate([{"segments": segs}], greedy, use_tqdm=False)[0]
            ttft.append(out.metrics["first_token_time"] - out.metrics["arrival_time"])
            tokens.append(out.outputs[0].token_ids)
        stats = llm.stats()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
        return {"mean_ttft_s": sum(ttft) / len(ttft), "ttft_s": ttft, "tokens": tokens,
                "segment_reused_tokens": stats.get("segment_reused_tokens", 0)}

    torch.manual_seed(0)
    result = {"machine": machine_info(), "settings": vars(a), "prompt_tokens": sum(map(len, prompts[0])), "runs": {}}
    ref = result["runs"]["full prefill"] = run(seed=0)
    print(f"full prefill: TTFT {ref['mean_ttft_s'] * 1000:.1f} ms", flush=True)
    for share in a.shares:
        r = result["runs"][str(share)] = run(seed=0, segment_reuse=True, segment_recompute=share)
        same = sum(x == y for t, u in zip(r["tokens"], ref["tokens"]) for x, y in zip(t, u))
        r["greedy_agreement"] = same / sum(len(t) for t in ref["tokens"])
        r["ttft_speedup"] = ref["mean_ttft_s"] / r["mean_ttft_s"]
        print(f"recompute {share}: TTFT {r['mean_ttft_s'] * 1000:.1f} ms ({r['ttft_speedup']:.2f}x), "
              f"greedy agreement {r['greedy_agreement']:.3f}, reused {r['segment_reused_tokens']:,} tokens", flush=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
