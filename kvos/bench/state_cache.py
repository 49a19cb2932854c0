"""``kvos bench state-cache``: a model with Mamba layers (random weights at a real size, e.g.
``--model bamba-9b --random-weights`` on a GPU): decode and prefill against their roofline, and a
multi-turn workload's later-turn TTFT with the state restored from the prefix cache vs without.

- **Decode**: ``--batch`` requests of ``--context`` tokens decode ``--decode-tokens`` tokens. The
  step time (``step_s``) is steady state: the wall time of the last ``decode_tokens // 2`` tokens
  over their count, the device synchronised only where that window opens and closes, so the
  host's work for a step overlaps the device's previous step as in any run. ``step_alone_s``:
  the median of the same steps each timed alone (device synchronised before and after: host and
  device in series). (Subtracting a one-token run from the whole run instead folds the prefill's
  run-to-run variation into the step: at batch 32 it read 37-46 ms for a 16 ms step.) Its floor:
  weights, plus per sequence its KV context (attention layers) and its state read and written
  once, over the GPU's measured copy bandwidth (``kvos.bench.roofline``).
- **Prefill**: one prompt of ``--prefill`` tokens, one output token: TTFT against ``max(2 x
  params x tokens + attention FLOPs / peak, weights / bandwidth)``.
- **Multi-turn**: ``--conversations`` chats of ``--turns`` turns; each turn's prompt is the chat so
  far plus ``--user-tokens`` new tokens, answered with ``--answer-tokens``; turns run one chat at
  a time (each TTFT a prefill alone). TTFT of turns after the first, prefix caching on (the state
  after the last cached block comes back with the KV) vs off.
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import time
from pathlib import Path


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--prefill", type=int, default=8192)
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--first-tokens", type=int, default=4096, help="tokens of each chat's first prompt")
    p.add_argument("--user-tokens", type=int, default=128)
    p.add_argument("--answer-tokens", type=int, default=64)
    p.add_argument("--output", default="benchmarks/results/state_cache.json")


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def _timed(llm, prompts: list[list[int]], max_tokens: int) -> tuple[float, list]:
    from kvos import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return time.perf_counter() - t0, outs


def _add_decodes(llm, prompts: list[list[int]], decode_tokens: int, tag: str) -> list[str]:
    """``prompts`` added to the engine, each to decode ``decode_tokens`` greedy tokens; their ids."""
    from kvos import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=decode_tokens, ignore_eos=True)
    ids = [f"{tag}-{len(prompts)}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        llm.engine.add_request({"prompt_token_ids": p}, sp, rid)
    return ids


def decode_step_s(llm, prompts: list[list[int]], decode_tokens: int) -> float:
    """The median time of the last ``decode_tokens // 2`` engine steps of ``prompts`` decoding
    ``decode_tokens`` tokens together (each step synchronised; see the module's docstring)."""
    import torch

    eng = llm.engine
    _add_decodes(llm, prompts, decode_tokens, "decode")
    times = []
    while eng.has_unfinished_requests():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        eng.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    tail = sorted(times[-(decode_tokens // 2):])
    return tail[len(tail) // 2]


def decode_steady_s(llm, prompts: list[list[int]], decode_tokens: int) -> float:
    """Seconds per decode step in steady state: the wall time of the last ``decode_tokens // 2``
    tokens of ``prompts`` decoding together, over the tokens made in it. The device is
    synchronised only where the window opens (every request has half its tokens) and closes, so
    the engine's host work for a step overlaps the previous step on the device (async
    scheduling), as in any run; the prompts' chunks are done before the window opens."""
    import torch

    eng = llm.engine
    ids = _add_decodes(llm, prompts, decode_tokens, "steady")
    made = dict.fromkeys(ids, 0)
    start: tuple[float, int] | None = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            made[o.request_id] = len(o.outputs[0].token_ids)
        if start is None and min(made.values()) >= decode_tokens // 2:
            torch.cuda.synchronize()
            start = time.perf_counter(), made[ids[0]]
    torch.cuda.synchronize()
    t0, tokens0 = start
    return (time.perf_counter() - t0) / (made[ids[0]] - tokens0)


def multi_turn(llm, a: argparse.Namespace, vocab: int) -> dict:
    """Later turns' mean TTFT and the tokens they found cached, after one untimed chat of other
    tokens and the same lengths (on a fresh machine the kernels compile there, not in a turn)."""
    _chats(llm, a, vocab, range(-1, 0))
    llm.reset_prefix_cache()
    return _chats(llm, a, vocab, range(a.conversations))


def _chats(llm, a: argparse.Namespace, vocab: int, ids: range) -> dict:
    """The chats numbered ``ids``, one after another: their later turns' mean TTFT and cached share."""
    ttfts, cached, prompt_tokens = [], 0, 0
    for c in ids:
        chat = _prompts(1, a.first_tokens, vocab, 100 + c)[0]
        for turn in range(a.turns):
            _, outs = _timed(llm, [chat], a.answer_tokens)
            o = outs[0]
            if turn:
                m = o.metrics
                ttfts.append(m["first_token_time"] - m["arrival_time"])
                cached += o.num_cached_tokens
                prompt_tokens += len(chat)
            chat = chat + list(o.outputs[0].token_ids) + _prompts(1, a.user_tokens, vocab, 1000 * c + turn)[0]
    return {"later_turn_ttft_s": sum(ttfts) / len(ttfts), "later_turns": len(ttfts),
            "cached_token_share": cached / prompt_tokens, "later_turn_ttfts_s": [round(t, 5) for t in ttfts]}


def run(a: argparse.Namespace) -> dict:
    import torch

    from kvos import LLM
    from kvos.bench.machine import machine_info
    from kvos.bench.roofline import measure_ceilings
    from kvos.config.flags import engine_kwargs

    kw = engine_kwargs(a)
    llm = LLM(**kw)
    eng = llm.engine
    mc = eng.model_config
    if mc.mamba is None:
        raise ValueError(f"model: {kw['model']} has no Mamba layers")
    if not torch.cuda.is_available():
        raise ValueError("kvos bench state-cache measures against a GPU's roofline: no GPU here")
    ceilings = measure_ceilings()
    bandwidth, peak = ceilings["hbm_GBps"] * 1e9, ceilings["bf16_gemm_TFLOPs"] * 1e12
    params = sum(p.numel() for p in eng.runner.model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in eng.runner.model.parameters())
    state = next(g.spec for g in eng.layout.groups if g.spec.kind == "mamba_state").data_bytes
    kv_per_token = sum(g.spec.bytes_per_token for g in eng.layout.groups)
    attn = len(mc.attention_layers)
    result: dict = {"machine": machine_info(), "engine": {k: v for k, v in kw.items()}, "params": params,
                    "weight_bytes": weight_bytes, "state_bytes_per_request": state,
                    "kv_bytes_per_token": kv_per_token, "ceilings": ceilings, "decode": [], "prefill": {}}
    out = Path(a.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    vocab = mc.vocab_size
    _timed(llm, _prompts(2, 64, vocab, 0), 4)  # warm-up
    for batch in a.batch:
        prompts = _prompts(batch, a.context, vocab, batch)
        llm.reset_prefix_cache()
        alone = decode_step_s(llm, prompts, a.decode_tokens)
        llm.reset_prefix_cache()
        step = decode_steady_s(llm, prompts, a.decode_tokens)
        floor = (weight_bytes + batch * ((a.context + a.decode_tokens / 2) * kv_per_token + 2 * state)) / bandwidth
        row = {"batch": batch, "context": a.context, "step_s": step, "roofline_step_s": floor,
               "fraction_of_roofline": floor / step, "output_tok_s": batch / step,
               "step_alone_s": alone, "fraction_of_roofline_step_alone": floor / alone}
        result["decode"].append(row)
        print("decode", json.dumps(row), flush=True)
        out.write_text(json.dumps(result, indent=2))
    llm.reset_prefix_cache()
    t, _ = _timed(llm, _prompts(1, a.prefill, vocab, 7), 1)
    n = a.prefill
    flops = 2 * params * n + 4 * attn * mc.num_heads * mc.head_dim * n * (n + 1) / 2
    floor = max(flops / peak, weight_bytes / bandwidth)
    result["prefill"] = {"tokens": n, "seconds": t, "roofline_s": floor, "fraction_of_roofline": floor / t}
    print("prefill", json.dumps(result["prefill"]), flush=True)
    llm.reset_prefix_cache()
    result["multi_turn"] = {"prefix_caching": multi_turn(llm, a, vocab)}
    del llm, eng
    gc.collect()
    torch.cuda.empty_cache()
    cold = LLM(**{**kw, "enable_prefix_caching": False})
    result["multi_turn"]["no_prefix_caching"] = multi_turn(cold, a, vocab)
    mt = result["multi_turn"]
    mt["ttft_speedup"] = mt["no_prefix_caching"]["later_turn_ttft_s"] / mt["prefix_caching"]["later_turn_ttft_s"]
    result["summary"] = {
        "decode_fraction_of_roofline": {r["batch"]: round(r["fraction_of_roofline"], 3) for r in result["decode"]},
        "decode_fraction_of_roofline_steps_alone": {r["batch"]: round(r["fraction_of_roofline_step_alone"], 3)
                                                    for r in result["decode"]},
        "prefill_fraction_of_roofline": round(result["prefill"]["fraction_of_roofline"], 3),
        "later_turn_ttft_speedup": round(mt["ttft_speedup"], 2)}
    out.write_text(json.dumps(result, indent=2))
    print(f"saved {out}")
    return result
