"""``kvos bench throughput --config llama-3.1-8b --random-weights`` on a GPU: kvos and HF
transformers ``generate`` on the same requests and the same weights, a decode-step
microbenchmark, and every figure against the roofline of the GPU's measured ceilings."""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from kvos.worker.device import resolve_device


def add_gpu_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("GPU workloads (with --random-weights or a CUDA device)")
    g.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32, 128, 256],
                   help="512 in / 128 out at these batch sizes")
    g.add_argument("--sharegpt-requests", type=int, default=1000)
    g.add_argument("--fixed-requests", type=int, default=1000, help="256 in / 256 out, all at once")
    g.add_argument("--micro-batches", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    g.add_argument("--micro-contexts", type=int, nargs="+", default=[512, 2048, 8192])
    g.add_argument("--hf-sharegpt-batch", type=int, default=128)
    g.add_argument("--hf-sharegpt-limit", type=int, default=None,
                   help="run transformers on only the first N ShareGPT-like requests (time)")
    g.add_argument("--skip", nargs="*", default=[], choices=["fixed", "sharegpt", "fixed1000", "micro", "hf"])


def sharegpt_like(n: int, vocab: int, seed: int) -> list[tuple[list[int], int]]:
    """Log-normal lengths shaped like ShareGPT conversations: input 4-1,024, output 4-512."""
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        p = min(1024, max(4, int(rng.lognormvariate(5.2, 1.0))))
        o = min(512, max(4, int(rng.lognormvariate(5.0, 1.0))))
        reqs.append(([rng.randrange(3, vocab) for _ in range(p)], o))
    return reqs


def fixed(n: int, prompt: int, output: int, vocab: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(3, vocab) for _ in range(prompt)], output) for _ in range(n)]


def run_kvos(llm, reqs, cost, ceilings: dict) -> dict:
    import torch

    from kvos import SamplingParams
    from kvos.bench.roofline import StepRecorder, TritonCompiles

    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in reqs]
    llm.reset_prefix_cache()
    recorder = StepRecorder(cost, ceilings)
    llm.engine.schedule_hook = recorder
    torch.cuda.synchronize()
    with recorder.time_device_waits(llm.engine.runner), TritonCompiles() as compiles:
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p, _ in reqs], params, use_tqdm=False)
        dt = time.perf_counter() - t0
        recorder.close(time.perf_counter())
    llm.engine.schedule_hook = None
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert out_tokens == sum(n for _, n in reqs)
    tiers = {t["name"]: {k: t[k] for k in ("hits_blocks", "stores_blocks", "skipped_writes", "evictions")}
             for t in llm.stats().get("tiers", [])}
    return {"seconds": dt, "requests": len(reqs), "output_tokens": out_tokens, "output_tok_s": out_tokens / dt,
            **({"tiers_cumulative": tiers} if tiers else {}),
            "req_s": len(reqs) / dt, "steps": recorder.steps, "ideal_seconds": recorder.ideal_seconds,
            "fraction_of_ideal": recorder.ideal_seconds / dt, "steps_by_kind": recorder.by_kind,
            "triton_compiles": compiles.as_dict()}


def run_hf(hf, reqs, batch_size: int) -> dict:
    """Static batches in order, left-padded; each runs to its longest output."""
    import torch

    t0 = time.perf_counter()
    for i in range(0, len(reqs), batch_size):
        batch = reqs[i : i + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in batch], device="cuda")
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch], device="cuda")
        new = max(n for _, n in batch)
        with torch.inference_mode():
            hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                        do_sample=False, pad_token_id=0, eos_token_id=None)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    out_tokens = sum(n for _, n in reqs)
    return {"seconds": dt, "requests": len(reqs), "output_tokens": out_tokens, "output_tok_s": out_tokens / dt,
            "req_s": len(reqs) / dt, "batch_size": batch_size}


def decode_micro(llm, cost, ceilings, batches: list[int], contexts: list[int]) -> list[dict]:
    """Time full decode steps (CUDA graph of the forward pass + the logits projection) over
    random block tables. Writes K/V into random pool slots: run it last on a throwaway engine."""
    import torch

    runner = llm.engine.runner
    g = runner.graphs
    nb = min(p.num_blocks for p in llm.engine.kv.pools)
    groups = len(llm.engine.kv.pools)
    bs = runner.block_size
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for ctx in contexts:
        for b in batches:
            blocks = -(-ctx // bs)
            if g is None or not g.can_run(b, blocks):
                continue
            tables = torch.randint(1, nb, (groups, b, blocks), dtype=torch.int32, device="cuda", generator=gen)
            seq_lens = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
            pos = torch.full((b,), ctx - 1, dtype=torch.long, device="cuda")
            slots = tables[:, :, (ctx - 1) // bs].long() * bs + (ctx - 1) % bs
            ids = torch.randint(3, runner.cfg.vocab_size, (b,), device="cuda", generator=gen)

            def step():
                with torch.inference_mode():
                    h = g.run(ids, pos, slots, tables, seq_lens)
                    return runner.model.compute_logits(h)

            for _ in range(3):
                step()
            times = []
            for _ in range(15):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                step()
                e1.record()
                e1.synchronize()
                times.append(e0.elapsed_time(e1) / 1e3)
            t = statistics.median(times)
            roof = cost.decode_seconds([ctx] * b, ceilings)
            rows.append({"batch": b, "context": ctx, "step_ms": t * 1e3, "roofline_ms": roof * 1e3,
                         "fraction_of_roofline": roof / t, "tok_s": b / t})
    return rows


def print_decode_micro(rows: list[dict], indent: str = "") -> None:
    for r in rows:
        print(f"{indent}decode b={r['batch']:>3} ctx={r['context']:>5}: {r['step_ms']:7.2f} ms, "
              f"roofline {r['roofline_ms']:7.2f} ms ({r['fraction_of_roofline']:.0%})", flush=True)


def run(a: argparse.Namespace) -> dict:
    import torch

    from kvos import LLM, SamplingParams
    from kvos.bench.machine import machine_info
    from kvos.bench.roofline import ModelCost, measure_ceilings
    from kvos.config.flags import engine_kwargs
    from kvos.models.hf_bridge import hf_model_sharing_weights
    from kvos.models.loader import load_model, resolve_config_path
    from kvos.worker.runner import parse_dtype

    ceilings = measure_ceilings()
    kw = engine_kwargs(a)
    kw["max_num_seqs"] = max(kw["max_num_seqs"], max(a.batch_sizes))
    path = resolve_config_path(kw["model"])
    dtype = parse_dtype(kw["dtype"] or "bfloat16")
    model = load_model(path, dtype, torch.device(resolve_device(kw["device"])), True)[1]  # the engine reuses it
    cfg = model.cfg
    vocab = cfg.vocab_size
    cost = ModelCost.of(model, dtype.itemsize)
    out = Path(a.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    result: dict = {"machine": machine_info(), "model": str(path), "ceilings": ceilings,
                    "engine": {k: v for k, v in kw.items() if k != "model"}, "workloads": {}}

    def save() -> None:
        out.write_text(json.dumps(result, indent=2))

    workloads = []  # (name, requests, transformers batch size, transformers request limit)
    if "fixed" not in a.skip:
        workloads += [(f"512in-128out-batch{b}", fixed(b, 512, 128, vocab, a.bench_seed + b), b, None)
                      for b in a.batch_sizes]
    if "sharegpt" not in a.skip:
        workloads.append((f"sharegpt-like-{a.sharegpt_requests}",
                          sharegpt_like(a.sharegpt_requests, vocab, a.bench_seed), a.hf_sharegpt_batch,
                          a.hf_sharegpt_limit))
    if "fixed1000" not in a.skip:
        workloads.append((f"256in-256out-{a.fixed_requests}",
                          fixed(a.fixed_requests, 256, 256, vocab, a.bench_seed), None, None))
    for name, *_ in workloads:
        result["workloads"][name] = {}
    if "hf" not in a.skip:  # first, with the whole GPU: transformers' dynamic cache grows by copies
        hf = hf_model_sharing_weights(model)
        run_hf(hf, fixed(2, 16, 4, vocab, 0), 2)  # warm-up
        for name, reqs, batch, limit in workloads:
            if batch:
                r = result["workloads"][name]["transformers"] = run_hf(hf, reqs[:limit] if limit else reqs, batch)
                print(name, "transformers", round(r["output_tok_s"], 1), "tok/s", flush=True)
                save()
        hf = None
        torch.cuda.empty_cache()
    t0 = time.perf_counter()
    llm = LLM(**kw)
    eng = llm.engine
    cost = ModelCost.of(model, dtype.itemsize, eng.layout)  # the KV dtype the engine stores
    result.update(startup_seconds=time.perf_counter() - t0, async_scheduling=eng.async_scheduling,
                  kv_pool_pages=eng.kv.pages.num_pages, kv_pool_GiB=eng.runner.kv_buffer.numel() / 2**30)
    llm.generate([{"prompt_token_ids": [5] * 64}], use_tqdm=False)  # warm-up: kernels compiled
    for name, reqs, _, _ in workloads:
        row = result["workloads"][name]
        # warm-up at the workload's shapes (its first batch, 4 tokens each): one-time costs such
        # as new pinned-memory and device-memory blocks stay out of the timed run
        # (other token ids: a tier below the device must not serve the timed run's prompts)
        warm = [[3 + t % (vocab - 3) for t in p] for p, _ in reqs[: kw["max_num_seqs"]]]
        llm.generate([{"prompt_token_ids": p} for p in warm],
                     SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        row["kvos"] = run_kvos(llm, reqs, cost, ceilings)
        if "transformers" in row:
            row["speedup_output_tok_s"] = row["kvos"]["output_tok_s"] / row["transformers"]["output_tok_s"]
        print(name, json.dumps({k: round(v, 3) for k, v in row["kvos"].items() if isinstance(v, float)}),
              "speedup", round(row.get("speedup_output_tok_s", 0), 2), flush=True)
        save()
    if "micro" not in a.skip:
        result["decode_micro"] = decode_micro(llm, cost, ceilings, a.micro_batches, a.micro_contexts)
        print_decode_micro(result["decode_micro"])
    result["summary"] = {name: {"kvos_tok_s": round(w["kvos"]["output_tok_s"], 1),
                                "kvos_req_s": round(w["kvos"]["req_s"], 2),
                                "fraction_of_ideal": round(w["kvos"]["fraction_of_ideal"], 3),
                                "hf_tok_s": round(w["transformers"]["output_tok_s"], 1) if "transformers" in w else None,
                                "speedup": round(w.get("speedup_output_tok_s", 0), 2)}
                         for name, w in result["workloads"].items()}
    save()
    print(json.dumps(result["summary"], indent=1))
    print(f"saved {out}")
    return result
