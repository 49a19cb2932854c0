"""``kvos bench kv-speed --config llama-3.1-8b --random-weights --device cuda``: the KV cache in
the model's dtype and in 8 bits side by side in one run: the KV tokens the pool holds (and the
planner's figure for the same bytes), decode steps at long contexts against a roofline that
counts the bytes each dtype reads (scales included), and a long-context workload's output tok/s."""
from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

from kvos.worker.device import resolve_device

KV_DTYPES = ("auto", "fp8_e4m3", "int8")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-dtypes", nargs="+", default=["auto", "fp8_e4m3"], choices=KV_DTYPES)
    p.add_argument("--requests", type=int, default=100, help="long-context workload: requests, all at once")
    p.add_argument("--prompt-len", type=int, default=16384)
    p.add_argument("--output-len", type=int, default=512)
    p.add_argument("--micro-batches", type=int, nargs="*", default=[64, 256])
    p.add_argument("--micro-contexts", type=int, nargs="*", default=[8192, 32768])
    p.add_argument("--bench-seed", type=int, default=0)
    p.add_argument("--output", default="benchmarks/results/kv_speed.json")


def pool_row(eng) -> dict:
    """What the pool holds, and what the planner says the same bytes hold."""
    from kvos.sim.planner import layout_capacity

    pages, layout = eng.kv.pages.num_pages, eng.layout
    spec = layout.groups[0].spec
    pool_bytes = eng.runner.kv_buffer.numel()
    planned = layout_capacity(layout, 32768, pool_bytes)
    return {"kv_cache_dtype": spec.dtype, "bytes_per_token": spec.bytes_per_token, "pool_GiB": pool_bytes / 2**30,
            "pool_pages": pages, "kv_tokens": (pages - 1) * layout.block_size if len(layout.groups) == 1 else None,
            "planner_pages_same_bytes": planned["num_pages"],
            "requests_of_32k": planned["max_concurrent_requests"]}


def run(a: argparse.Namespace) -> dict:
    import torch

    from kvos import LLM
    from kvos.bench.gpu_throughput import (
        decode_micro,
        fixed,
        print_decode_micro,
        run_kvos,
    )
    from kvos.bench.hybrid import run_plain
    from kvos.bench.machine import machine_info
    from kvos.bench.roofline import ModelCost, measure_ceilings
    from kvos.config.flags import engine_kwargs

    kw = engine_kwargs(a)
    cuda = resolve_device(kw["device"]).startswith("cuda")
    if a.micro_batches:
        kw["max_num_seqs"] = max(kw["max_num_seqs"], max(a.micro_batches))
    ceilings = measure_ceilings() if cuda else {"hbm_GBps": 1.0, "bf16_gemm_TFLOPs": 1.0}
    result: dict = {"machine": machine_info(), "model": kw["model"], "ceilings": ceilings,
                    "engine": {k: v for k, v in kw.items() if k not in ("model", "kv_cache_dtype")}, "kv_dtypes": {}}
    out = Path(a.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    for kv_dtype in a.kv_dtypes:
        t0 = time.perf_counter()
        llm = LLM(**{**kw, "kv_cache_dtype": kv_dtype})
        eng = llm.engine
        row: dict = {"startup_seconds": time.perf_counter() - t0, **pool_row(eng)}
        print(kv_dtype, "pool holds", row["kv_tokens"], "KV tokens", f"({row['bytes_per_token']} B each)", flush=True)
        cost = ModelCost.of(eng.runner.model, eng.runner.dtype.itemsize, eng.layout)
        reqs = fixed(a.requests, a.prompt_len, a.output_len, eng.model_config.vocab_size, a.bench_seed)
        llm.generate([{"prompt_token_ids": p} for p, _ in reqs[:2]], use_tqdm=False)  # warm-up
        run_row = run_kvos(llm, reqs, cost, ceilings) if cuda else run_plain(llm, reqs)
        row["long_context"] = {"requests": a.requests, "prompt_len": a.prompt_len, "output_len": a.output_len,
                               **run_row}
        print(kv_dtype, "long-context", round(run_row["output_tok_s"], 1), "output tok/s", flush=True)
        if cuda and a.micro_batches:
            longest = max(a.micro_contexts)
            eng.runner.capture_cuda_graphs(kw["max_num_seqs"], longest + 1, max_context=longest)
            row["decode_micro"] = decode_micro(llm, cost, ceilings, a.micro_batches, a.micro_contexts)
            print_decode_micro(row["decode_micro"], "  ")
        result["kv_dtypes"][kv_dtype] = row
        out.write_text(json.dumps(result, indent=2))
        del llm, eng
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    result["summary"] = summarize(result["kv_dtypes"])
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result["summary"], indent=2))
    print(f"saved {out}")
    return result


def summarize(rows: dict) -> dict:
    """Each 8-bit dtype against ``auto``: tokens held, long-context tok/s and decode-step speed-ups."""
    base = rows.get("auto")
    summary = {}
    for name, r in rows.items():
        s = {"kv_tokens": r["kv_tokens"], "output_tok_s": round(r["long_context"]["output_tok_s"], 1),
             "decode_fraction_of_roofline": {f"b{m['batch']}_ctx{m['context']}": round(m["fraction_of_roofline"], 3)
                                             for m in r.get("decode_micro", [])}}
        if base is not None and name != "auto":
            s["tokens_vs_auto"] = round(r["kv_tokens"] / base["kv_tokens"], 3) if base["kv_tokens"] else None
            s["output_tok_s_vs_auto"] = round(r["long_context"]["output_tok_s"] / base["long_context"]["output_tok_s"], 3)
            steps = {(m["batch"], m["context"]): m["step_ms"] for m in base.get("decode_micro", [])}
            s["decode_speedup_vs_auto"] = {f"b{m['batch']}_ctx{m['context']}": round(steps[(m["batch"], m["context"])]
                                                                                      / m["step_ms"], 3)
                                           for m in r.get("decode_micro", []) if (m["batch"], m["context"]) in steps}
        summary[name] = s
    return summary
