"""``kvos bench throughput``: kvos vs HF transformers ``generate`` on the same requests, and
time to first token with a shared system prompt cached vs not."""
from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from kvos.bench import gpu_throughput
from kvos.bench.gpu_throughput import add_gpu_args
from kvos.worker.device import resolve_device


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--min-prompt", type=int, default=32)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--min-output", type=int, default=16)
    p.add_argument("--max-output", type=int, default=128)
    p.add_argument("--hf-batch-size", type=int, nargs="+", default=[8, 16],
                   help="static batch sizes for transformers (the best one is compared)")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--system-prompt-tokens", type=int, default=1000)
    p.add_argument("--ttft-requests", type=int, default=8)
    p.add_argument("--bench-seed", type=int, default=0)
    p.add_argument("--output", default=None,
                   help="default: benchmarks/results/throughput-cpu.json (-gpu.json on a GPU)")
    add_gpu_args(p)


def make_requests(a, vocab: int, special: set[int]) -> list[tuple[list[int], int]]:
    rng = random.Random(a.bench_seed)
    ok = [t for t in range(vocab) if t not in special]
    return [([rng.choice(ok) for _ in range(rng.randint(a.min_prompt, a.max_prompt))],
             rng.randint(a.min_output, a.max_output)) for _ in range(a.num_requests)]


def run_kvos(llm, reqs) -> dict:
    from kvos import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in reqs]
    llm.reset_prefix_cache()
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in reqs], params)
    dt = time.perf_counter() - t0
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"seconds": dt, "output_tokens": out_tokens, "output_tok_s": out_tokens / dt,
            "total_tok_s": (out_tokens + sum(len(p) for p, _ in reqs)) / dt}


def run_hf(model_path: Path, reqs, batch_size: int) -> dict:
    """Padded static batches, in arrival order; each batch runs to its longest output and only
    the requested tokens count."""
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM

    if model_path.is_dir():
        model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(model_path.parent), gguf_file=model_path.name,
                                                     dtype=torch.float32)
    model.eval()
    pad = 0
    t0 = time.perf_counter()
    for i in tqdm(range(0, len(reqs), batch_size), desc="transformers"):
        batch = reqs[i : i + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])
        new = max(n for _, n in batch)
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=pad)
    dt = time.perf_counter() - t0
    out_tokens = sum(n for _, n in reqs)
    return {"seconds": dt, "output_tokens": out_tokens, "output_tok_s": out_tokens / dt,
            "total_tok_s": (out_tokens + sum(len(p) for p, _ in reqs)) / dt, "batch_size": batch_size}


def run_ttft(llm, a, vocab: int, special: set[int]) -> dict:
    """Each request alone: shared system prompt + a distinct question, one output token."""
    from kvos import SamplingParams

    rng = random.Random(a.bench_seed + 1)
    ok = [t for t in range(vocab) if t not in special]
    system = [rng.choice(ok) for _ in range(a.system_prompt_tokens)]
    prompts = [system + [rng.choice(ok) for _ in range(32)] for _ in range(a.ttft_requests)]
    sp = SamplingParams(temperature=0, max_tokens=1)

    def ttft(prompt, reset: bool) -> tuple[float, int]:
        if reset:
            llm.reset_prefix_cache()
        t0 = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
        return time.perf_counter() - t0, out.num_cached_tokens

    ttft(prompts[0], reset=True)  # warm up the code paths
    cold = [ttft(p, reset=True) for p in prompts]
    llm.generate([{"prompt_token_ids": system + [ok[0]]}], sp, use_tqdm=False)
    warm = [ttft(p, reset=False) for p in prompts]
    cold_ms = sum(t for t, _ in cold) / len(cold) * 1000
    warm_ms = sum(t for t, _ in warm) / len(warm) * 1000
    return {"system_prompt_tokens": a.system_prompt_tokens, "requests": len(prompts),
            "cold_ttft_ms": cold_ms, "warm_ttft_ms": warm_ms, "speedup": cold_ms / warm_ms,
            "warm_cached_tokens_mean": sum(c for _, c in warm) / len(warm),
            "cold_cached_tokens_mean": sum(c for _, c in cold) / len(cold)}


def run(a: argparse.Namespace) -> dict:
    if a.random_weights or resolve_device(a.device).startswith("cuda"):
        a.output = a.output or "benchmarks/results/throughput-gpu.json"
        return gpu_throughput.run(a)
    a.output = a.output or "benchmarks/results/throughput-cpu.json"
    from kvos import LLM
    from kvos.bench.machine import machine_info
    from kvos.config.flags import engine_kwargs

    llm = LLM(**engine_kwargs(a))
    tok = llm.get_tokenizer()
    vocab = llm.engine.model_config.vocab_size
    special = set(tok.all_special_ids)
    reqs = make_requests(a, vocab, special)
    kvos_res = run_kvos(llm, reqs)
    result: dict = {"machine": machine_info(), "model": str(llm.engine.model_path),
                    "workload": {k: getattr(a, k) for k in ("num_requests", "min_prompt", "max_prompt",
                                                            "min_output", "max_output", "bench_seed")},
                    "engine": {k: v for k, v in engine_kwargs(a).items() if k != "model"},
                    "kvos": kvos_res}
    if not a.skip_hf:
        runs = [run_hf(llm.engine.model_path, reqs, bs) for bs in a.hf_batch_size]
        hf = max(runs, key=lambda r: r["output_tok_s"])
        result["transformers_runs"] = runs
        result["transformers"] = hf
        result["speedup_output_tok_s"] = kvos_res["output_tok_s"] / hf["output_tok_s"]
    result["prefix_ttft"] = run_ttft(llm, a, vocab, special)
    result["summary"] = {
        "kvos_output_tok_s": round(kvos_res["output_tok_s"], 1),
        "transformers_output_tok_s": round(result["transformers"]["output_tok_s"], 1) if not a.skip_hf else None,
        "transformers_batch_size": result["transformers"]["batch_size"] if not a.skip_hf else None,
        "ratio": round(result.get("speedup_output_tok_s", 0.0), 2),
        "ttft_cold_ms": round(result["prefix_ttft"]["cold_ttft_ms"], 1),
        "ttft_warm_ms": round(result["prefix_ttft"]["warm_ttft_ms"], 1),
        "machine": f"{result['machine']['cpu']} ({result['machine']['cores']} cores)",
    }
    out = Path(a.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"saved {out}")
    return result
