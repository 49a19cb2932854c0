"""``kvos bench speculative``: one stream, with and without n-gram speculation, on workloads
where drafts pay (quoting a passage, editing a file given in the prompt, a second turn that
revises the first answer) and where they do not (free chat). Chat-templated prompts on the
default model; the same engine options for both engines; each workload's requests run one at a
time, the rounds interleaved, the best round of each kept. Reports output tok/s, tokens per
step, acceptance, and whether the greedy outputs are identical."""
from __future__ import annotations

import argparse
import inspect
import json
import time
from pathlib import Path

DATA = Path(__file__).parent / "data"


def workloads(passages: int) -> dict[str, list[list[dict]]]:
    """Chat conversations per workload (the model answers the last user turn)."""
    text = (DATA / "macbeth_act1_scene5-act2.txt").read_text()
    paras = []  # ~700-character passages from line starts, spread over the text
    for i in range(passages):
        start = text.index("\n", 1000 + i * 4000) + 1
        paras.append(text[start: text.rindex("\n", start, start + 700)])
    from kvos.spec import ngram  # a real source file to edit

    source = inspect.getsource(ngram)
    code = [source[i: i + 1800] for i in range(0, min(len(source), 1800 * passages), 1800)][: passages]
    out = {
        "quote": [[{"role": "user", "content": f"Copy out this passage exactly, line by line.\n\n{p}"}] for p in paras],
        "code_edit": [[{"role": "user", "content": "Rename the variable `tokens` to `ids` everywhere in this "
                        f"Python code and print the whole code again.\n\n```python\n{c}\n```"}] for c in code],
        "multi_turn": [[{"role": "user", "content": f"Summarise this passage in three sentences.\n\n{p}"},
                        {"role": "assistant", "content": p[:400]},
                        {"role": "user", "content": "Repeat your answer, word for word, then add one sentence."}]
                       for p in paras],
        "free_chat": [[{"role": "user", "content": q}] for q in (
            "Tell me a short story about a lighthouse keeper.", "What should I cook tonight? Give three ideas.",
            "Explain why the sky is blue to a child.", "Write a poem about autumn rain.")][: passages],
    }
    return out


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--spec-config", default='{"method": "ngram", "num_speculative_tokens": 4, '
                   '"prompt_lookup_min": 2, "prompt_lookup_max": 4}', help="the speculative engine's config (JSON)")
    p.add_argument("--prompts", type=int, default=3, help="conversations per workload")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--workloads", nargs="+", default=["quote", "code_edit", "multi_turn", "free_chat"])
    p.add_argument("--prompt-ids", default=None, metavar="JSON",
                   help="take the prompts' token ids from an earlier result file (a machine without the tokenizer)")
    p.add_argument("--verify-cost", action="store_true",
                   help="instead: time decode steps (1 token per sequence) against verify steps (k + 1) at "
                        "batch 1-64 on the engine's model (e.g. --config llama-3.1-8b --random-weights)")
    p.add_argument("--context", type=int, default=1024, help="--verify-cost: tokens before each step")
    p.add_argument("--output", default="benchmarks/results/speculative-cpu.json")


def run(a: argparse.Namespace) -> dict:
    from kvos import LLM, SamplingParams
    from kvos.bench.machine import machine_info
    from kvos.config.flags import engine_kwargs

    kw = engine_kwargs(a)
    kw.pop("speculative_config", None)
    if a.verify_cost:
        return verify_cost(a, kw)
    if a.prompt_ids:
        kw["skip_tokenizer_init"] = True
    plain = LLM(**kw)
    spec = LLM(**kw, speculative_config=a.spec_config)
    tok = plain.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=a.output_len)
    if a.prompt_ids:
        saved = json.loads(Path(a.prompt_ids).read_text())["prompt_ids"]
        prompts = {w: [{"prompt_token_ids": ids} for ids in saved[w]] for w in a.workloads}
    else:
        convs = workloads(a.prompts)
        prompts = {w: [{"prompt_token_ids": plain.chat_token_ids(c)} for c in convs[w]] for w in a.workloads}
    for llm in (plain, spec):  # warm up
        llm.generate([prompts[a.workloads[0]][0]], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    rows: dict[str, dict] = {}
    for w in a.workloads:
        best = {"plain": float("inf"), "spec": float("inf")}
        outs: dict[str, list] = {}
        for _ in range(a.rounds):
            for name, llm in (("plain", plain), ("spec", spec)):
                llm.reset_prefix_cache()
                e = llm.engine
                steps0, stats0 = e.steps, dict(e.spec_stats.as_dict())
                t0 = time.perf_counter()
                got = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts[w]]  # one stream
                dt = time.perf_counter() - t0
                if dt < best[name]:
                    best[name] = dt
                    outs[name] = got
                    if name == "spec":
                        s1 = e.spec_stats.as_dict()
                        spec_steps = e.steps - steps0
                        proposed, accepted = s1["proposed"] - stats0["proposed"], s1["accepted"] - stats0["accepted"]
                    else:
                        plain_steps = e.steps - steps0
        n_out = sum(len(o.outputs[0].token_ids) for o in outs["spec"])
        spec_ids = [list(o.outputs[0].token_ids) for o in outs["spec"]]
        plain_ids = [list(o.outputs[0].token_ids) for o in outs["plain"]]
        same = spec_ids == plain_ids
        # plain decoding of the same prompts as one batch: how far batch shape alone moves greedy tokens
        batched = [list(o.outputs[0].token_ids) for o in plain.generate(prompts[w], params, use_tqdm=False)]
        rows[w] = {"output_tokens": n_out, "plain_tok_s": n_out / best["plain"], "spec_tok_s": n_out / best["spec"],
                   "speedup": best["plain"] / best["spec"], "plain_tokens_per_step": n_out / max(1, plain_steps),
                   "spec_tokens_per_step": n_out / max(1, spec_steps), "proposed": proposed, "accepted": accepted,
                   "acceptance_rate": accepted / proposed if proposed else 0.0, "greedy_identical": same,
                   "common_prefix_tokens": [common_prefix(a, b) for a, b in zip(spec_ids, plain_ids)],
                   "plain_batched_identical": batched == plain_ids,
                   "plain_batched_common_prefix_tokens": [common_prefix(a, b) for a, b in zip(batched, plain_ids)],
                   "sample_output": tok.decode(outs["spec"][0].outputs[0].token_ids)[:160] if tok else None}
        print(w, json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in rows[w].items()
                             if k != "sample_output"}), flush=True)
    result = {"machine": machine_info(), "engine": {k: v for k, v in kw.items() if v is not None},
              "speculative_config": json.loads(a.spec_config),
              "workload": {"prompts_per_workload": a.prompts, "output_len": a.output_len, "streams": 1,
                           "sampling": "greedy", "rounds": a.rounds},
              "rows": rows, "prompt_ids": {w: [p["prompt_token_ids"] for p in ps] for w, ps in prompts.items()}}
    result["summary"] = {w: {k: round(r[k], 3) if isinstance(r[k], float) else r[k]
                             for k in ("speedup", "spec_tokens_per_step", "acceptance_rate", "greedy_identical")}
                         for w, r in rows.items()}
    Path(a.output).parent.mkdir(parents=True, exist_ok=True)
    Path(a.output).write_text(json.dumps(result, indent=2, default=str))
    print(f"saved {a.output}")
    return result


def verify_cost(a: argparse.Namespace, kw: dict) -> dict:
    """Seconds per step, decode (1 token per sequence) against verify (``k + 1``), at batch
    1-64 and ``--context`` tokens, straight on the engine's runner (greedy verification with
    drafts that are never accepted: the cost of a step, not of a workload)."""
    import torch

    from kvos import LLM, SamplingParams
    from kvos.bench.machine import machine_info
    from kvos.core.step import SampleTarget, StepDescription, StepSeq

    k = json.loads(a.spec_config)["num_speculative_tokens"]
    llm = LLM(**kw, speculative_config=a.spec_config)  # graphs captured for the verify rows too
    runner, bs = llm.engine.runner, llm.engine.kv.block_size
    greedy = SamplingParams(temperature=0)
    per_seq = -(-(a.context + k + 1) // bs)

    def step(batch: int, drafts: int) -> StepDescription:
        seqs = []
        for i in range(batch):
            table = list(range(1 + i * per_seq, 1 + (i + 1) * per_seq))
            seqs.append(StepSeq(f"s{i}", a.context, 1 + drafts, [7] * (1 + drafts), [table] * len(runner.group_caches),
                                [SampleTarget(f"s{i}", greedy, 0, 0)], None, [8] * drafts))
        return StepDescription(seqs, [], [])

    def timed(desc: StepDescription, reps: int = 20) -> float:
        for _ in range(3):
            runner.execute(desc)
        sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        for _ in range(reps):
            runner.execute(desc)
        sync()
        return (time.perf_counter() - t0) / reps

    rows = []
    for batch in (1, 2, 4, 8, 16, 32, 64):
        if batch * per_seq >= llm.engine.kv.pages.num_pages:
            break
        d, v = timed(step(batch, 0)), timed(step(batch, k))
        rows.append({"batch": batch, "decode_ms": d * 1e3, "verify_ms": v * 1e3, "verify_over_decode": v / d,
                     "break_even_accepted": v / d - 1})
        print(json.dumps({key: round(val, 3) for key, val in rows[-1].items()}), flush=True)
    result = {"machine": machine_info(), "engine": {key: val for key, val in kw.items() if val is not None},
              "num_speculative_tokens": k, "context": a.context, "rows": rows,
              "summary": {r["batch"]: round(r["verify_over_decode"], 3) for r in rows}}
    Path(a.output).parent.mkdir(parents=True, exist_ok=True)
    Path(a.output).write_text(json.dumps(result, indent=2, default=str))
    print(f"saved {a.output}")
    return result
