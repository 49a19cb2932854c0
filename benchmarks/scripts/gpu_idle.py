"""Where a batch-256 decode phase spends its time on the GPU: kernel time per decode step and
the idle gaps between kernels, from a torch.profiler trace of a real engine run
(random weights of a bundled config, default llama-3.1-8b; argv[2]: "on"/"off" async)."""
import random
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from kvos import LLM, SamplingParams

cfg = sys.argv[1] if len(sys.argv) > 1 else "llama-3.1-8b"
async_on = (sys.argv[2] if len(sys.argv) > 2 else "on") == "on"
llm = LLM(model=cfg, random_weights=True, device="cuda", max_num_batched_tokens=8192, max_num_seqs=256,
          async_scheduling=async_on)
rng = random.Random(0)
vocab = llm.engine.model_config.vocab_size
reqs = [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(512)]} for _ in range(256)]
sp = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
llm.generate(reqs[:8], sp, use_tqdm=False)
llm.reset_prefix_cache()


def timed(obj, name, acc):
    """Add the wall time of each ``obj.name`` call to ``acc[name]`` (measurement only)."""
    fn = getattr(obj, name)

    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            acc[name] = acc.get(name, 0.0) + time.perf_counter() - t

    setattr(obj, name, wrapper)


eng = llm.engine
host: dict[str, float] = {}
for obj, name in [(eng.scheduler, "schedule"), (eng.runner, "launch"), (eng.runner, "collect"),
                  (eng.runner, "_prepare"), (eng.scheduler, "update_from_output"), (eng, "_finish_step"),
                  (eng, "step")]:
    timed(obj, name, host)
t0 = time.perf_counter()
llm.generate(reqs, sp, use_tqdm=False)
total = time.perf_counter() - t0
print("host seconds over a whole run (no profiler):", {k: round(v, 3) for k, v in host.items()},
      "total", round(total, 3))
llm.reset_prefix_cache()
with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
    llm.generate(reqs, sp, use_tqdm=False)
    torch.cuda.synchronize()
evs = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
# decode steps: from the first graph-replayed kernel after the last prefill-attention kernel
last_prefill = max(e.time_range.end for e in evs if "prefill" in e.name)
dec = [e for e in evs if e.time_range.start > last_prefill]
busy, idle, gaps, end = 0.0, 0.0, [], dec[0].time_range.start
for e in dec:
    s, t = e.time_range.start, e.time_range.end
    if s > end:
        idle += s - end
        gaps.append((s - end, e.name[:60]))
    busy += max(0, t - max(s, end))
    end = max(end, t)
span = end - dec[0].time_range.start
print(f"{cfg} async={async_on}: decode phase {span / 1e3:.1f} ms, GPU busy {busy / 1e3:.1f} ms, idle {idle / 1e3:.1f} ms "
      f"over {len(dec)} kernels/copies (47 decode steps)")
print("largest gaps (us, next kernel):", [(round(g), n) for g, n in sorted(gaps, reverse=True)[:12]])
by = {}
for e in dec:
    by[e.name[:50]] = by.get(e.name[:50], 0) + (e.time_range.end - e.time_range.start)
for n, t in sorted(by.items(), key=lambda x: -x[1])[:15]:
    print(f"{t / 1e3:9.2f} ms  {n}")

api = {}
for e in prof.events():
    if e.device_type.name == "CPU" and e.name.startswith("cuda") and e.time_range.start > last_prefill:
        n, tot, mx = api.get(e.name, (0, 0.0, 0.0))
        d = e.time_range.end - e.time_range.start
        api[e.name] = (n + 1, tot + d, max(mx, d))
print("CUDA runtime calls during the decode phase (count, total ms, max ms):")
for n, (c, tot, mx) in sorted(api.items(), key=lambda x: -x[1][1])[:12]:
    print(f"  {n}: {c}, {tot / 1e3:.1f}, {mx / 1e3:.2f}")
