"""GPU kernel times of a Mamba hybrid's (default bamba-9b, random weights) prefill of one
``--prefill``-token prompt and of eager decode steps at batch 1 and 32 (1K context), from
torch.profiler, grouped by kernel name."""
import argparse
import random
import time

import torch
from torch.profiler import ProfilerActivity, profile

from kvos import LLM, SamplingParams

p = argparse.ArgumentParser()
p.add_argument("--model", default="bamba-9b")
p.add_argument("--prefill", type=int, default=8192)
p.add_argument("--rows", type=int, default=14)
p.add_argument("--max-num-batched-tokens", type=int, default=2048)
p.add_argument("--prefill-only", action="store_true")
a = p.parse_args()
llm = LLM(model=a.model, random_weights=True, device="cuda", enforce_eager=True,
          max_num_batched_tokens=a.max_num_batched_tokens)
eng = llm.engine
rng = random.Random(0)


def prompt(n):
    return {"prompt_token_ids": [rng.randrange(3, 30000) for _ in range(n)]}


def show(name, prof, steps):
    rows = sorted(((e.key, e.device_time_total / 1e3 / steps, e.count // steps) for e in prof.key_averages()
                   if e.device_time_total > 0), key=lambda r: -r[1])
    total = sum(r[1] for r in rows)
    print(f"== {name}: {total:.2f} ms of kernels per step")
    for k, t, c in rows[:a.rows]:
        print(f"  {t:8.3f} ms {c:5d}x  {k[:90]}")


sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
llm.generate([prompt(64)], sp, use_tqdm=False)
llm.generate([prompt(a.prefill)], sp, use_tqdm=False)
torch.cuda.synchronize()
t0 = time.perf_counter()
llm.generate([prompt(a.prefill)], sp, use_tqdm=False)
torch.cuda.synchronize()
print(f"prefill {a.prefill}: {time.perf_counter() - t0:.3f} s eager")
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    llm.generate([prompt(a.prefill)], sp, use_tqdm=False)
    torch.cuda.synchronize()
show(f"prefill {a.prefill} (whole)", prof, 1)
for batch in () if a.prefill_only else (1, 32):
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for i in range(batch):
        eng.add_request(prompt(1024), sp, f"d{batch}-{i}")
    for _ in range(1024 * batch // 2048 + 4):
        eng.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        eng.step()
    torch.cuda.synchronize()
    print(f"decode batch {batch}: {(time.perf_counter() - t0) / 5 * 1e3:.2f} ms/step eager")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            eng.step()
        torch.cuda.synchronize()
    show(f"decode batch {batch}", prof, 5)
    while eng.has_unfinished_requests():
        eng.step()
