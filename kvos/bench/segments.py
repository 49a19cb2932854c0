"""``kvos bench segments``: what segment reuse costs in accuracy and saves in time, on the real
models (CPU): SmolLM2-135M-Instruct and Gemma 3 270M.

A RAG-style set: ``--num-docs`` documents (excerpts of Macbeth Act I scene V to Act II, shipped
in ``data/``, about ``--doc-tokens`` tokens each) and ``--num-prompts`` prompts, each a shared
instruction, ``--docs-per-prompt`` of the documents in a shuffled order, then a question about
one of them (seeded). Every prompt is sent as segments (instruction, each document, question).

For each recompute share (``--shares``) a fresh engine with ``segment_reuse`` caches the
documents alone first (one request per document), then runs the prompts one at a time; the
reference is an engine without segment reuse (prefix caching on, as users run it), whose
documents were sent alone first too. Per share:

- **Greedy agreement** with the reference: each prompt's ``--max-tokens`` greedy tokens
  (``ignore_eos``), position by position, and the mean identical prefix.
- **Teacher-forced logit error**: the logits at each position of the *reference's*
  continuation (one request per prompt: the prompt plus the continuation, the continuation in
  the last segment; the rows' hidden states read with the runner's ``hidden_hook``), mean and max
  absolute difference against the reference's own.
- **Perplexity** of the reference's continuation from those logits, and its change in percent.
- **TTFT**: the mean over prompts of first token minus arrival, each prompt alone on the engine
  (so a TTFT is that prompt's prefill), with the documents cached.

``1.0`` recomputes every token (a check of the harness: it must equal the reference up to float
rounding, since the prompt is then computed as full prefill would).
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import random
import time
from pathlib import Path

from kvos.bench.kv_quant import PROMPT_TEXT, _excerpt

MODELS = {"smollm2": None, "gemma-3-270m": "gemma-3-270m"}  # name -> LLM(model=...)
SHARES = (0.0, 0.05, 0.15, 0.3, 1.0)
INSTRUCTION = "You are given passages from a play. Read them, then answer the question that follows.\n\n"
QUESTIONS = ["Who speaks first in the passage that begins \"{line}\"?",
             "Summarise in one sentence the passage that begins \"{line}\".",
             "What happens right after the line \"{line}\"?",
             "Which characters appear in the passage that begins \"{line}\"?"]


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--shares", nargs="+", type=float, default=list(SHARES),
                   help="segment_recompute shares compared with full prefill")
    p.add_argument("--num-docs", type=int, default=6)
    p.add_argument("--doc-tokens", type=int, default=300, help="tokens per document (whole lines)")
    p.add_argument("--docs-per-prompt", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=24, help="greedy tokens per prompt (ignore_eos)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--segment-header", default="model", choices=["model", "first_segment"],
                   help="what the documents are cached after (EngineConfig.segment_header)")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=1 << 30)
    p.add_argument("--out", "--output", dest="out", default="benchmarks/segments_cpu.json")


def build_set(tok, num_docs: int, doc_tokens: int, per_prompt: int, num_prompts: int, seed: int):
    """Documents (text) and prompts (lists of segment texts)."""
    lines = [x for x in PROMPT_TEXT.read_text().split("\n")]
    docs = []
    for d in range(num_docs):
        start = d * len(lines) // num_docs
        while not lines[start % len(lines)].strip():
            start += 1
        docs.append(_excerpt(lines, lambda t: tok(t, add_special_tokens=False).input_ids, start, doc_tokens)
                    + "\n\n")
    rng = random.Random(seed)
    prompts = []
    for p in range(num_prompts):
        chosen = rng.sample(range(num_docs), per_prompt)
        target = docs[rng.choice(chosen)]
        line = next(x for x in target.split("\n") if x.strip())
        question = "Question: " + QUESTIONS[p % len(QUESTIONS)].format(line=line.strip()[:60]) + "\nAnswer:"
        prompts.append([INSTRUCTION, *(docs[c] for c in chosen), question])
    return docs, prompts


def _collect_logits(engine, rid: str, first: int) -> dict[int, object]:
    """Install a hook that keeps ``rid``'s float32 logits at positions >= ``first``, by position."""
    rows: dict[int, object] = {}
    model = engine.runner.model

    def hook(where, hidden) -> None:
        idx = [i for i, (r, pos) in enumerate(where) if r == rid and pos >= first]
        if idx:
            logits = model.compute_logits(hidden[idx]).float()
            for i, row in zip(idx, logits):
                rows[where[i][1]] = row.clone()

    engine.runner.hidden_hook = hook
    return rows


def run_workload(llm, docs: list[str], prompts: list[list[str]], max_tokens: int,
                 forced: list[list[int]] | None, desc: str) -> dict:
    """Cache the documents alone, then per prompt: greedy tokens and TTFT, and the logits along
    ``forced`` continuations (the engine's own greedy ones when None)."""
    import torch

    from kvos import SamplingParams

    eng = llm.engine
    one = SamplingParams(temperature=0, max_tokens=1)
    warm = [{"segments": [INSTRUCTION, d, "."]} for d in docs]  # each document cached as its header mode keys it
    llm.generate(warm, one, use_tqdm=False)
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    tokens, ttft, cached = [], [], []
    for segs in prompts:
        out = llm.generate([{"segments": segs}], greedy, use_tqdm=False)[0]
        tokens.append(out.outputs[0].token_ids)
        ttft.append(out.metrics["first_token_time"] - out.metrics["arrival_time"])
        cached.append(out.num_cached_tokens)
    forced = forced or tokens
    # the greedy runs cached their continuations: start again from the documents alone, so that
    # no prefix hit reaches the positions read here
    eng.reset_prefix_cache()
    llm.generate(warm, one, use_tqdm=False)
    logits = []
    try:
        for p, segs in enumerate(prompts):
            _, ids, spans = eng.tokenize_segments(segs)
            rid = f"{desc}-tf{p}"
            rows = _collect_logits(eng, rid, len(ids) - 1)
            last = list(spans[-1])
            eng.add_request({"prompt_token_ids": ids + forced[p][:-1],
                             "segment_spans": [*spans[:-1], (last[0], len(ids) + len(forced[p]) - 1)]},
                            one, request_id=rid)
            while eng.has_unfinished_requests():
                eng.step()
            assert sorted(rows) == list(range(len(ids) - 1, len(ids) - 1 + len(forced[p]))), sorted(rows)
            logits.append(torch.stack([rows[k] for k in sorted(rows)]))
    finally:
        eng.runner.hidden_hook = None
    return {"tokens": tokens, "forced_logits": logits, "ttft": ttft, "cached_tokens": cached,
            "prompt_tokens": [len(eng.tokenize_segments(s)[1]) for s in prompts], "stats": llm.stats()}


def compare(ref: dict, cand: dict, forced: list[list[int]]) -> dict:
    """Agreement, logit error and perplexity of a candidate run against the reference run."""
    import torch

    same = total = prefix = 0
    err_sum, count, mx = 0.0, 0, 0.0
    nll_ref = nll = 0.0
    for rt, ct, rl, cl, f in zip(ref["tokens"], cand["tokens"], ref["forced_logits"], cand["forced_logits"], forced):
        eq = [a == b for a, b in zip(rt, ct)]
        same += sum(eq)
        total += len(eq)
        prefix += next((i for i, e in enumerate(eq) if not e), len(eq))
        d = (cl - rl).abs()
        err_sum += float(d.double().sum())
        count += d.numel()
        mx = max(mx, float(d.max()))
        idx = torch.tensor(f)[:, None]
        nll_ref -= float(torch.log_softmax(rl.double(), -1).gather(1, idx).sum())
        nll -= float(torch.log_softmax(cl.double(), -1).gather(1, idx).sum())
    n = sum(len(f) for f in forced)
    ppl_ref, ppl = math.exp(nll_ref / n), math.exp(nll / n)
    ttft = sum(cand["ttft"]) / len(cand["ttft"])
    return {"greedy_agreement": same / total, "mean_identical_prefix": prefix / len(forced),
            "mean_abs_logit_error": err_sum / count, "max_abs_logit_error": mx, "perplexity": ppl,
            "reference_perplexity": ppl_ref, "ppl_delta_pct": 100 * (ppl / ppl_ref - 1),
            "mean_ttft_s": ttft, "ttft_speedup": (sum(ref["ttft"]) / len(ref["ttft"])) / ttft,
            "mean_cached_tokens": sum(cand["cached_tokens"]) / len(forced),
            "segment_reused_tokens": cand["stats"].get("segment_reused_tokens", 0),
            "segment_recomputed_tokens": cand["stats"].get("segment_recomputed_tokens", 0)}


def run(a: argparse.Namespace) -> dict:
    from kvos import LLM
    from kvos.bench.machine import machine_info

    if a.docs_per_prompt > a.num_docs or min(a.num_prompts, a.max_tokens, a.docs_per_prompt) < 1:
        raise ValueError("need 1 <= --docs-per-prompt <= --num-docs, --num-prompts >= 1, --max-tokens >= 1")
    if any(not 0 <= s <= 1 for s in a.shares):
        raise ValueError("--shares must be in [0, 1]")
    engine_kw = {"kv_cache_memory_bytes": a.kv_cache_memory_bytes}
    settings = {k: getattr(a, k) for k in ("num_docs", "doc_tokens", "docs_per_prompt", "num_prompts", "max_tokens",
                                           "seed", "segment_header")}
    result: dict = {"machine": machine_info(), "engine": engine_kw, "settings": settings, "models": {}}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for name in a.models:
        t0 = time.perf_counter()
        llm = LLM(model=MODELS[name], **engine_kw)
        docs, prompts = build_set(llm.get_tokenizer(), a.num_docs, a.doc_tokens, a.docs_per_prompt,
                                  a.num_prompts, a.seed)
        ref = run_workload(llm, docs, prompts, a.max_tokens, None, f"{name}-ref")
        lengths = ref["prompt_tokens"]
        print(f"{name}: {len(prompts)} prompts of {min(lengths)}-{max(lengths)} tokens, {a.num_docs} documents; "
              f"full prefill (prefix caching on) TTFT {sum(ref['ttft']) / len(ref['ttft']):.3f} s", flush=True)
        row: dict = {"prompt_lengths": lengths, "reference_mean_ttft_s": sum(ref["ttft"]) / len(ref["ttft"]),
                     "reference_mean_cached_tokens": sum(ref["cached_tokens"]) / len(prompts), "shares": {}}
        del llm
        gc.collect()
        for share in a.shares:
            llm = LLM(model=MODELS[name], segment_reuse=True, segment_recompute=share,
                      segment_header=a.segment_header, **engine_kw)
            cand = run_workload(llm, docs, prompts, a.max_tokens, ref["tokens"], f"{name}-{share}")
            r = compare(ref, cand, ref["tokens"])
            row["shares"][str(share)] = r
            print(f"  recompute {share:<5} agreement {r['greedy_agreement']:.3f} (prefix {r['mean_identical_prefix']:.1f}), "
                  f"logit error mean {r['mean_abs_logit_error']:.2e} max {r['max_abs_logit_error']:.2e}, "
                  f"ppl {r['perplexity']:.3f} ({r['ppl_delta_pct']:+.2f}%), TTFT {r['mean_ttft_s']:.3f} s "
                  f"({r['ttft_speedup']:.2f}x)", flush=True)
            del llm, cand
            gc.collect()
        row["seconds"] = time.perf_counter() - t0
        result["models"][name] = row
        out.write_text(json.dumps(result, indent=2))
    result["summary"] = {f"{m} {s}": {k: r[k] for k in ("greedy_agreement", "mean_abs_logit_error", "max_abs_logit_error",
                                                        "ppl_delta_pct", "mean_ttft_s", "ttft_speedup")}
                         for m, row in result["models"].items() for s, r in row["shares"].items()}
    out.write_text(json.dumps(result, indent=2))
    print(table(result))
    print(f"saved {out}")
    return result


def table(result: dict) -> str:
    """The result as a markdown table."""
    lines = ["| model | recompute | greedy agreement | identical prefix | mean abs logit err | max abs logit err "
             "| perplexity | ppl delta | TTFT | vs full prefill |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for m, row in result["models"].items():
        lines.append(f"| {m} | full prefill | 1.000 | {result['settings']['max_tokens']:.1f} | 0 | 0 | "
                     f"{next(iter(row['shares'].values()))['reference_perplexity']:.3f} | 0 | "
                     f"{row['reference_mean_ttft_s'] * 1000:.0f} ms | 1.00x |")
        for s, r in row["shares"].items():
            lines.append(f"| {m} | {float(s):.0%} | {r['greedy_agreement']:.3f} | {r['mean_identical_prefix']:.1f} | "
                         f"{r['mean_abs_logit_error']:.2e} | {r['max_abs_logit_error']:.2e} | {r['perplexity']:.3f} | "
                         f"{r['ppl_delta_pct']:+.2f}% | {r['mean_ttft_s'] * 1000:.0f} ms | {r['ttft_speedup']:.2f}x |")
    return "\n".join(lines)
