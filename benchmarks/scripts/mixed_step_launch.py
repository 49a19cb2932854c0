"""Host launch time against GPU time of steps with prefill rows (Llama-3.1-8B shape, random
weights, one GPU). ``MIXED=N`` sets ``mixed_graph_tokens`` (0: those steps run eagerly).

1. The ShareGPT-like workload (1,000 requests) after a 300-request warm-up: per step kind, the
   host time of ``ModelRunner.launch``, the GPU span from its first to its last queued op, and
   the GPU's idle gap before the step.
2. One step of 256 decodes (context 600) beside one prefill chunk of P tokens, alone: the host's
   launch time, and the GPU time with every kernel already queued (the stream held by a sleep
   kernel while the host launches).
3. ``PROFILE=1``: the kernel table of that step (eager) for P = 128 and 1,024.

Figures: benchmarks/throughput.md (piecewise CUDA graphs)."""
import json
import os
import time

import torch

from kvos import LLM, SamplingParams
from kvos.bench.gpu_throughput import sharegpt_like
from kvos.models.attention import AttentionMetadata

llm = LLM(model="llama-3.1-8b", random_weights=True, device="cuda", max_num_batched_tokens=8192, max_num_seqs=256,
          mixed_graph_tokens=int(os.environ.get("MIXED", "1024")))
r = llm.engine.runner
print("startup", llm.engine.startup_s, "mixed graphs", r.mixed_graphs is not None)
recs: list[dict] = []
orig_launch = r.launch


def launch(step, *a, **k):
    nt = sum(s.num_new_tokens for s in step.seqs)
    nd = sum(1 for s in step.seqs if s.num_new_tokens == 1)
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    t0 = time.perf_counter()
    out = orig_launch(step, *a, **k)
    t1 = time.perf_counter()
    e1.record()
    recs.append(dict(T=nt, nd=nd, n=len(step.seqs), host=t1 - t0, e=(e0, e1)))
    return out


r.launch = launch
reqs = sharegpt_like(1000, r.model.cfg.vocab_size, 0)
params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in reqs]
llm.generate([{"prompt_token_ids": p} for p, _ in reqs[:300]], params[:300], use_tqdm=False)  # warm-up
recs.clear()
llm.reset_prefix_cache()
torch.cuda.synchronize()
t0 = time.perf_counter()
llm.generate([{"prompt_token_ids": p} for p, _ in reqs], params, use_tqdm=False)
wall = time.perf_counter() - t0
torch.cuda.synchronize()
prev, buckets = None, {}
for x in recs:
    e0, e1 = x.pop("e")
    x["span"], x["gap"] = e0.elapsed_time(e1) / 1e3, prev.elapsed_time(e0) / 1e3 if prev is not None else 0.0
    prev = e1
    kind = ("decode" if x["nd"] == x["n"] else "mixed<=512" if x["T"] <= 512 else
            "mixed<=2048" if x["T"] <= 2048 else "mixed>2048")
    b = buckets.setdefault(kind, dict(steps=0, T=0, host=0.0, span=0.0, gap=0.0))
    b["steps"] += 1
    b["T"] += x["T"]
    for k in ("host", "span", "gap"):
        b[k] += x[k]
print("wall", round(wall, 2), "steps", len(recs))
print(json.dumps({k: dict(steps=v["steps"], meanT=round(v["T"] / v["steps"]),
                          **{f"{m}_ms": round(1e3 * v[m] / v["steps"], 2) for m in ("host", "span", "gap")})
                  for k, v in buckets.items()}))

bs, dev, m = r.block_size, "cuda", r.model
G = len(r.group_caches)


def mixed_meta(nd: int, ctx: int, P: int):
    nb, nbp = -(-ctx // bs), -(-P // bs)
    tables = torch.zeros(nd + 1, max(nb, nbp), dtype=torch.int32, device=dev)
    tables[:nd, :nb] = torch.arange(1, 1 + nd * nb, dtype=torch.int32, device=dev).view(nd, nb)
    tables[nd, :nbp] = torch.arange(1 + nd * nb, 1 + nd * nb + nbp, dtype=torch.int32, device=dev)
    pos = torch.cat([torch.full((nd,), ctx - 1, device=dev), torch.arange(P, device=dev)])
    seq = torch.cat([torch.arange(nd, device=dev), torch.full((P,), nd, device=dev)])
    slots = tables[seq, pos // bs].long() * bs + pos % bs
    meta = AttentionMetadata(
        slot_mapping=slots, block_tables=tables, seq_lens=torch.tensor([ctx] * nd + [P], dtype=torch.int32, device=dev),
        query_lens_list=[1] * nd + [P], seq_lens_list=[ctx] * nd + [P], num_decodes=nd, block_size=bs,
        prefill_start_loc=torch.tensor([0, P], dtype=torch.int32, device=dev), max_prefill_len=P)
    return pos, meta


with torch.inference_mode():
    for P in (32, 128, 512, 1024, 4096):
        pos, meta = mixed_meta(256, 600, P)
        metas = [meta for _ in r.layer_group]
        ids = torch.randint(3, 1000, (256 + P,), device=dev)
        if r.mixed_graphs is not None and r.mixed_graphs.can_run(256 + P):
            def fwd():
                return r.mixed_graphs.run(ids, pos, meta.slot_mapping.view(1, -1).expand(G, -1), metas)
        else:
            def fwd():
                return m(ids, pos, r.kv_layers, metas, r.backend)
        for _ in range(3):
            fwd()
        torch.cuda.synchronize()
        hosts, gpus = [], []
        for _ in range(5):
            torch.cuda._sleep(200_000_000)  # the stream waits while the host queues the step
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            t0 = time.perf_counter()
            fwd()
            hosts.append(time.perf_counter() - t0)
            e1.record()
            torch.cuda.synchronize()
            gpus.append(e0.elapsed_time(e1) / 1e3)
        print(f"P={P} T={256 + P}: host launch {1e3 * min(hosts):.2f} ms, GPU {1e3 * min(gpus):.2f} ms")
        if os.environ.get("PROFILE") == "1" and P in (128, 1024):
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                m(ids, pos, r.kv_layers, metas, r.backend)
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=70))
