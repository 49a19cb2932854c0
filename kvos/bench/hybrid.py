"""``kvos bench hybrid --config gemma-3-12b --random-weights --device cuda``: the three KV
layouts of a hybrid (sliding-window) model side by side in one run: how many long requests the
pool holds, the KV waste at that load, long-context throughput, and decode steps against a
roofline that counts only the KV each layer must read."""
from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

from kvos.worker.device import resolve_device

LAYOUTS = ("homogeneous", "equal_pages", "unified")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    p.add_argument("--capacity-context", type=int, default=32768,
                   help="tokens per request when counting how many requests the pool holds")
    p.add_argument("--requests", type=int, default=32, help="long-context workload: requests, all at once")
    p.add_argument("--prompt-len", type=int, default=7680)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--micro-batches", type=int, nargs="*", default=[1, 16, 64])
    p.add_argument("--micro-contexts", type=int, nargs="*", default=[2048, 8192])
    p.add_argument("--bench-seed", type=int, default=0)
    p.add_argument("--output", default="benchmarks/results/hybrid.json")


class _Seq:
    def __init__(self, rid: str, n: int) -> None:
        self.request_id, self.all_token_ids, self.cache_salt, self.priority = rid, list(range(n)), None, 0
        self.num_computed_tokens = 0

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


def count_capacity(layout, num_pages: int, context: int, chunk: int) -> dict:
    """Requests of ``context`` tokens that the engine's own allocator holds at once in
    ``num_pages`` pages, each prefilled in chunks of ``chunk`` then one decode step (sliding
    groups have released what left the window), and the memory breakdown at that load."""
    from kvos.cache.kv_manager import KVCacheManager

    kv = KVCacheManager(layout, num_pages, enable_caching=False)
    n = 0
    while True:
        seq = _Seq(f"r{n}", context + 1)
        done = 0
        while done < context + 1:
            step = min(chunk, context - done) or 1
            if not kv.allocate_slots(seq, step):
                kv.free(seq)
                return {"requests": n, "context": context, **kv.memory_breakdown(),
                        "pages": num_pages, "page_bytes": layout.large_page_bytes}
            done += step
            seq.num_computed_tokens = done
        n += 1


def run_plain(llm, reqs: list[tuple[list[int], int]]) -> dict:
    """The workload without a roofline (CPU): wall time, output tok/s, most sequences running."""
    from kvos import SamplingParams

    eng = llm.engine
    peak = 0

    def watch(_out) -> None:
        nonlocal peak
        peak = max(peak, len(eng.scheduler.running))

    eng.schedule_hook = watch
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in reqs],
                        [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in reqs], use_tqdm=False)
    dt = time.perf_counter() - t
    eng.schedule_hook = None
    toks = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"seconds": dt, "output_tokens": toks, "output_tok_s": toks / dt, "peak_running": peak}


def run(a: argparse.Namespace) -> dict:
    import torch

    from kvos import LLM
    from kvos.bench.gpu_throughput import (
        decode_micro,
        fixed,
        print_decode_micro,
        run_kvos,
    )
    from kvos.bench.machine import machine_info
    from kvos.bench.roofline import ModelCost, measure_ceilings
    from kvos.config.flags import engine_kwargs

    kw = engine_kwargs(a)
    cuda = resolve_device(kw["device"]).startswith("cuda")
    ceilings = measure_ceilings() if cuda else {"hbm_GBps": 1.0, "bf16_gemm_TFLOPs": 1.0}
    result: dict = {"machine": machine_info(), "model": kw["model"], "ceilings": ceilings,
                    "engine": {k: v for k, v in kw.items() if k not in ("model", "kv_layout")}, "layouts": {}}
    out = Path(a.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    for layout in a.layouts:
        t0 = time.perf_counter()
        llm = LLM(**{**kw, "kv_layout": layout})
        eng = llm.engine
        row: dict = {"startup_seconds": time.perf_counter() - t0, "groups": eng.layout.describe(),
                     "pool_pages": eng.kv.pages.num_pages, "pool_GiB": eng.runner.kv_buffer.numel() / 2**30}
        row["capacity"] = count_capacity(eng.layout, eng.kv.pages.num_pages, a.capacity_context,
                                         kw["max_num_batched_tokens"])
        print(layout, "holds", row["capacity"]["requests"], f"requests of {a.capacity_context} tokens, waste",
              f"{row['capacity']['waste_fraction']:.2%}", flush=True)
        cfg = eng.model_config
        cost = ModelCost.of(eng.runner.model, eng.runner.dtype.itemsize, eng.layout)
        reqs = fixed(a.requests, a.prompt_len, a.output_len, cfg.vocab_size, a.bench_seed)
        llm.generate([{"prompt_token_ids": p} for p, _ in reqs[:2]], use_tqdm=False)  # warm-up
        run_row = run_kvos(llm, reqs, cost, ceilings) if cuda else run_plain(llm, reqs)
        row["long_context"] = {"requests": a.requests, "prompt_len": a.prompt_len, "output_len": a.output_len,
                               **run_row}
        print(layout, "long-context", round(run_row["output_tok_s"], 1), "output tok/s", flush=True)
        if cuda and a.micro_batches:
            row["decode_micro"] = decode_micro(llm, cost, ceilings, a.micro_batches, a.micro_contexts)
            print_decode_micro(row["decode_micro"], "  ")
        result["layouts"][layout] = row
        out.write_text(json.dumps(result, indent=2))
        del llm, eng
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    base = result["layouts"].get("homogeneous")
    result["summary"] = {
        name: {"requests_at_context": r["capacity"]["requests"],
               "waste_pct": round(100 * r["capacity"]["waste_fraction"], 2),
               "vs_homogeneous": round(r["capacity"]["requests"] / max(1, base["capacity"]["requests"]), 2) if base else None,
               "output_tok_s": round(r["long_context"]["output_tok_s"], 1)}
        for name, r in result["layouts"].items()}
    out.write_text(json.dumps(result, indent=2))
    print(f"saved {out}")
    return result
