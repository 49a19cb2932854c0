"""``kvos bench kv-quant``: what a quantized KV cache costs in accuracy, on the real models (CPU).

For each model (SmolLM2-135M-Instruct, Gemma 3 270M) a reference engine with ``kv_cache_dtype
= "auto"`` (the model's dtype: float32 on the CPU) runs the workload first; then a fresh engine
per KV dtype (``auto`` again, ``fp8_e4m3``, ``int8``) runs the same workload and is compared
with it. ``auto`` against the reference checks the harness itself: it must be exact.

- **Greedy agreement**: each prompt's ``--max-tokens`` greedy tokens (``ignore_eos``), position by
  position against the reference's, and the mean length of the identical prefix.
- **Logit error, teacher-forced**: the engine's float32 logits at each of those positions given
  the *reference's* continuation, against the reference's own logits there, read with the
  runner's ``logits_hook`` from requests ``prompt + continuation[:j]`` (``max_tokens=1``). One
  request ``prompt + continuation[:-1]`` runs first, so the others hit its cached blocks and
  compute at most one block each. Exact: the logits are the engine's own at each position (the
  KV a position reads does not depend on how the prompt was chunked, quantized KV included),
  not a reconstruction from top-k logprobs.
- **Perplexity**: ``exp(mean NLL)`` of a fixed public-domain text (``data/``), from
  ``prompt_logprobs=0`` (the whole text is one request when it fits the model's context, else
  windows of it), and its difference to the reference's in percent.

Engines use the engine's default layout (``--kv-layout``; accuracy is the same in every layout,
attention applies the window either way). ``nonfinite_logit_rows`` counts logit rows with a NaN
or inf (this bench found them once: a reused page's stale bytes in masked decode slots).

Prompts are built deterministically: a fixed list of instructions and excerpts of Macbeth (Act I
scene V to Act II; the perplexity text is Act I scenes I-IV, so they never overlap), the long
ones over ``--long-prompt-tokens``. SmolLM2 (an instruct model) gets them through its chat
template; Gemma 3 270M (a base model) as plain text.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import time
from pathlib import Path

DATA = Path(__file__).parent / "data"
PPL_TEXT = DATA / "macbeth_act1_scenes1-4.txt"
PROMPT_TEXT = DATA / "macbeth_act1_scene5-act2.txt"
KV_DTYPES = ("auto", "fp8_e4m3", "int8")
MODELS = {"smollm2": None, "gemma-3-270m": "gemma-3-270m"}  # name -> LLM(model=...)
CHAT = {"smollm2": True, "gemma-3-270m": False}

QUESTIONS = [
    "Explain in two sentences what a KV cache is in a transformer language model.",
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "List five rivers of Europe and the countries they flow through.",
    "What is the difference between a process and a thread?",
    "Translate to French: 'The weather is lovely today, let us walk to the harbour.'",
    "Give three tips for writing clear technical documentation.",
    "Why is the sky blue? Answer for a ten-year-old.",
    "Describe the water cycle step by step.",
    "Write a haiku about autumn leaves.",
    "What are the main causes of inflation?",
]
EXCERPT_TOKENS = [64, 128, 256, 384, 512, 768, 1024]
TASKS = ["Summarise this passage from Macbeth.", "Who speaks in this passage, and what do they want?",
         "Continue this scene in the same style.", "Explain this passage in plain modern English."]


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--kv-dtypes", nargs="+", default=list(KV_DTYPES), choices=list(KV_DTYPES),
                   help="KV dtypes compared with the reference run (auto: a check of the harness, exact)")
    p.add_argument("--num-prompts", type=int, default=20, help="prompts, the long ones included")
    p.add_argument("--long-prompts", type=int, default=3, help="prompts over --long-prompt-tokens tokens")
    p.add_argument("--long-prompt-tokens", type=int, default=1500)
    p.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per prompt (ignore_eos)")
    p.add_argument("--ppl-tokens", type=int, default=0,
                   help="tokens of the perplexity text scored (0: all of it, about 4,100)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=1 << 30)
    p.add_argument("--kv-layout", default="unified", choices=["unified", "equal_pages", "homogeneous"],
                   help="cache layout of hybrid models (Gemma 3)")
    p.add_argument("--out", "--output", dest="out", default="benchmarks/kv_quant_cpu.json")


# -- workload ------------------------------------------------------------------------------
def _excerpt(lines: list[str], tokenize, start: int, tokens: int) -> str:
    """Whole lines of ``lines`` from ``start`` (wrapping) until they reach ``tokens`` tokens."""
    out: list[str] = []
    i = start
    while len(tokenize("\n".join(out))) < tokens:
        out.append(lines[i % len(lines)])
        i += 1
    return "\n".join(out)


def build_prompts(name: str, llm, num_prompts: int, long_prompts: int, long_tokens: int) -> list[list[int]]:
    """``num_prompts`` prompts as token ids, the first ``long_prompts`` of them longer than
    ``long_tokens`` tokens (template included), the rest alternating questions and excerpts of
    ``EXCERPT_TOKENS`` tokens."""
    tok = llm.get_tokenizer()
    lines = PROMPT_TEXT.read_text().split("\n")

    def tokenize(text: str) -> list[int]:
        return tok(text, add_special_tokens=False).input_ids

    def encode(text: str, task: str | None) -> list[int]:
        if CHAT[name]:
            content = f"{task}\n\n{text}" if task else text
            return llm.chat_token_ids([{"role": "user", "content": content}])
        return tok(text if task else f"Question: {text}\nAnswer:").input_ids

    prompts: list[list[int]] = []
    for i in range(min(long_prompts, num_prompts)):  # long: evenly spread over the text
        start = i * len(lines) // max(1, long_prompts)
        ids = encode(_excerpt(lines, tokenize, start, long_tokens + 32), TASKS[i % len(TASKS)])
        assert len(ids) > long_tokens
        prompts.append(ids)
    q = e = 0
    while len(prompts) < num_prompts:
        if (len(prompts) - long_prompts) % 2 == 0 and q < len(QUESTIONS):
            prompts.append(encode(QUESTIONS[q], None))
            q += 1
        else:
            n = EXCERPT_TOKENS[e % len(EXCERPT_TOKENS)]
            start = (e * 7919) % len(lines)
            prompts.append(encode(_excerpt(lines, tokenize, start, n), TASKS[e % len(TASKS)]))
            e += 1
    return prompts


def _run(engine, requests: list[tuple[str, list[int], object]], desc: str) -> dict:
    """Run (request id, prompt ids, SamplingParams) to completion on ``engine``; outputs by id."""
    from tqdm.auto import tqdm

    for rid, ids, sp in requests:
        engine.add_request({"prompt_token_ids": ids}, sp, request_id=rid)
    done: dict = {}
    with tqdm(total=len(requests), desc=desc, unit="req", leave=False) as bar:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
                    bar.update(1)
    return done


def run_workload(llm, prompts: list[list[int]], max_tokens: int, forced: list[list[int]] | None,
                 ppl_ids: list[int], desc: str) -> dict:
    """Greedy continuations, teacher-forced logits on ``forced`` continuations (the engine's own
    when None), and the perplexity of ``ppl_ids``."""
    import torch

    from kvos import SamplingParams

    eng = llm.engine
    t0 = time.perf_counter()
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = _run(eng, [(f"g{p}", ids, greedy) for p, ids in enumerate(prompts)], f"{desc} greedy")
    tokens = [outs[f"g{p}"].outputs[0].token_ids for p in range(len(prompts))]
    forced = forced or tokens
    t1 = time.perf_counter()

    one = SamplingParams(temperature=0, max_tokens=1)
    logits: dict[str, torch.Tensor] = {}

    def hook(ids, rows) -> None:
        for rid, row in zip(ids, rows):
            if rid.startswith("t"):
                logits[rid] = row.clone()

    eng.runner.logits_hook = hook
    try:  # first the longest of each prompt (its blocks cached), then the rest (prefix hits)
        _run(eng, [(f"t{p}-{max_tokens - 1}", ids + forced[p][:-1], one) for p, ids in enumerate(prompts)],
             f"{desc} forced")
        _run(eng, [(f"t{p}-{j}", ids + forced[p][:j], one) for p, ids in enumerate(prompts)
                   for j in range(max_tokens - 1)], f"{desc} forced")
    finally:
        eng.runner.logits_hook = None
    forced_logits = [torch.stack([logits[f"t{p}-{j}"] for j in range(max_tokens)]) for p in range(len(prompts))]
    t2 = time.perf_counter()

    ctx = eng.max_model_len - 1
    nll, n = 0.0, 0
    windows = [ppl_ids[a: a + ctx] for a in range(0, len(ppl_ids), ctx)]
    scored = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    outs = _run(eng, [(f"p{w}", ids, scored) for w, ids in enumerate(windows) if len(ids) > 1], f"{desc} ppl")
    for w, ids in enumerate(windows):
        if len(ids) > 1:
            plps = outs[f"p{w}"].prompt_logprobs
            nll -= sum(plps[i][ids[i]] for i in range(1, len(ids)))
            n += len(ids) - 1
    t3 = time.perf_counter()
    return {"tokens": tokens, "forced_logits": forced_logits, "ppl": math.exp(nll / n), "ppl_scored_tokens": n, "ppl_windows": len(windows),
            "seconds": {"greedy": t1 - t0, "teacher_forced": t2 - t1, "perplexity": t3 - t2}}


def compare(ref: dict, cand: dict) -> dict:
    """Agreement and logit error of a candidate run against the reference run."""
    import torch

    same = total = prefix = top1 = nonfinite = 0
    err_sum, maxes, count = 0.0, [], 0
    for rt, ct, rl, cl in zip(ref["tokens"], cand["tokens"], ref["forced_logits"], cand["forced_logits"]):
        eq = [a == b for a, b in zip(rt, ct)]
        same += sum(eq)
        total += len(eq)
        prefix += next((i for i, e in enumerate(eq) if not e), len(eq))
        top1 += int((cl.argmax(-1) == rl.argmax(-1)).sum())
        nonfinite += int((~torch.isfinite(cl).all(-1)).sum())
        d = (cl - rl).abs()
        err_sum += float(d.double().sum())
        maxes.append(d.max())
        count += d.numel()
    n = len(ref["tokens"])
    return {"greedy_agreement": same / total, "mean_identical_prefix": prefix / n,
            "forced_top1_agreement": top1 / total, "mean_abs_logit_error": err_sum / count,
            "max_abs_logit_error": float(torch.stack(maxes).max()),  # NaN shows, as in the mean
            "nonfinite_logit_rows": nonfinite, "perplexity": cand["ppl"],
            "ppl_delta_pct": 100 * (cand["ppl"] / ref["ppl"] - 1), "seconds": cand["seconds"]}


# -- the bench -----------------------------------------------------------------------------
def run(a: argparse.Namespace) -> dict:
    from kvos import LLM
    from kvos.bench.machine import machine_info

    if a.long_prompts > a.num_prompts or a.num_prompts < 1 or a.max_tokens < 1:
        raise ValueError("need 1 <= --num-prompts, --long-prompts <= --num-prompts and --max-tokens >= 1")
    engine_kw = {"max_num_batched_tokens": a.max_num_batched_tokens, "kv_cache_memory_bytes": a.kv_cache_memory_bytes,
                 "kv_layout": a.kv_layout}
    result: dict = {"machine": machine_info(), "engine": engine_kw,
                    "settings": {k: getattr(a, k) for k in ("num_prompts", "long_prompts", "long_prompt_tokens",
                                                            "max_tokens", "ppl_tokens")},
                    "ppl_text": PPL_TEXT.name, "models": {}}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for name in a.models:
        t0 = time.perf_counter()
        llm = LLM(model=MODELS[name], kv_cache_dtype="auto", **engine_kw)
        prompts = build_prompts(name, llm, a.num_prompts, a.long_prompts, a.long_prompt_tokens)
        ppl_ids = llm.get_tokenizer()(PPL_TEXT.read_text()).input_ids
        ppl_ids = ppl_ids[: a.ppl_tokens] if a.ppl_tokens else ppl_ids
        lengths = [len(p) for p in prompts]
        print(f"{name}: {len(prompts)} prompts of {min(lengths)}-{max(lengths)} tokens "
              f"({sum(n > a.long_prompt_tokens for n in lengths)} over {a.long_prompt_tokens}), "
              f"perplexity on {len(ppl_ids)} tokens", flush=True)
        ref = run_workload(llm, prompts, a.max_tokens, None, ppl_ids, f"{name} reference")
        row: dict = {"prompt_lengths": lengths, "ppl_tokens": len(ppl_ids), "ppl_windows": ref["ppl_windows"],
                     "max_model_len": llm.engine.max_model_len, "reference_ppl": ref["ppl"],
                     "reference_seconds": ref["seconds"], "kv_dtypes": {}}
        del llm
        gc.collect()
        for dtype in a.kv_dtypes:
            llm = LLM(model=MODELS[name], kv_cache_dtype=dtype, **engine_kw)
            layout = llm.engine.layout
            cand = run_workload(llm, prompts, a.max_tokens, ref["tokens"], ppl_ids, f"{name} {dtype}")
            r = {"kv_cache_dtype": llm.engine.kv_cache_dtype,
                 "kv_bytes_per_token": sum(g.spec.bytes_per_token for g in layout.groups), **compare(ref, cand)}
            row["kv_dtypes"][dtype] = r
            print(f"  {dtype:<9} agreement {r['greedy_agreement']:.3f} (prefix {r['mean_identical_prefix']:.1f}), "
                  f"logit error mean {r['mean_abs_logit_error']:.2e} max {r['max_abs_logit_error']:.2e}, "
                  f"ppl {r['perplexity']:.3f} ({r['ppl_delta_pct']:+.3f}%)", flush=True)
            del llm, cand
            gc.collect()
        row["seconds"] = time.perf_counter() - t0
        result["models"][name] = row
        out.write_text(json.dumps(result, indent=2))
    result["summary"] = {f"{m} {d}": {k: r[k] for k in ("kv_bytes_per_token", "greedy_agreement", "mean_identical_prefix",
                                                        "mean_abs_logit_error", "max_abs_logit_error", "perplexity",
                                                        "ppl_delta_pct")}
                         for m, row in result["models"].items() for d, r in row["kv_dtypes"].items()}
    out.write_text(json.dumps(result, indent=2))
    print(table(result))
    print(f"saved {out}")
    return result


def table(result: dict) -> str:
    """The result as a markdown table."""
    head = ("| model | KV dtype | KV bytes/token | greedy agreement | identical prefix | mean abs logit err "
            "| max abs logit err | perplexity | ppl delta |")
    lines = [head, "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for m, row in result["models"].items():
        for d, r in row["kv_dtypes"].items():
            lines.append(f"| {m} | {d} | {r['kv_bytes_per_token']:,} | {r['greedy_agreement']:.3f} | "
                         f"{r['mean_identical_prefix']:.1f} | {r['mean_abs_logit_error']:.2e} | "
                         f"{r['max_abs_logit_error']:.2e} | {r['perplexity']:.3f} | {r['ppl_delta_pct']:+.3f}% |")
    return "\n".join(lines)
