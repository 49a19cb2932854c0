"""``kvos bench fleet``: several real engines behind one router (``DataParallelEngine``) on a
multi-turn chat workload, each router side by side; and 1 prefill + 1 decode engine
(disaggregated), whose KV transfer rate is set against the measured GPU-to-GPU copy rate.

Setup, and why:
- Workload: ``--conversations`` chats of ``--turns`` turns each, token ids only (no tokenizer):
  every chat opens with one of ``--system-prompts`` shared system prompts (``--system-len``
  tokens), then each turn adds a user message (``--user-len`` tokens) and the engine's greedy
  reply (``--max-tokens``, EOS ignored). Turn k's prompt is the system prompt, then user_1,
  reply_1, ..., user_k, where each reply is the tokens the engine actually returned, so a later
  turn's prompt extends what an engine cached at the previous turn, and the shared system
  prompts are hits on whichever engine already holds them. This is the traffic a prefix-aware
  router exists for: a router that sends a chat's next turn elsewhere recomputes its history.
- Load, closed loop (the default): ``--concurrency`` chats run at once (a chat's turns run one
  after another), so the fleet sees ``--concurrency`` requests at most, and a slower fleet is
  offered less. Open loop (``--arrival-rate R``): chats start at Poisson times, R per second
  (seeded: the same times for every run), however many are in flight, each turn still after
  the previous one's reply; every router then faces the same arrivals, and one that computes
  more queues more.
- Runs: ``--data-parallel`` engines behind each of ``--routers``, each run with fresh engines
  (empty caches) and the same prompts (same seed). With ``--prefill-decode``, one more run: one
  engine prefills every prompt and sends its KV blocks to one engine that decodes (router
  kv_aware on both sides). Its TTFT and TPOT compare with the data-parallel runs' on the same
  number of GPUs. Before timing, ``--warmup-requests`` requests of other token ids go through
  each fleet (compilation and first-use costs are not timed; the router's figures are counted
  from after the warm-up).
- Measured per run: wall time of the timed part, output tok/s, TTFT (from the ``submit`` call
  to the first output carrying tokens, so a disaggregated request's prefill and transfer count),
  TPOT per request ((last output - first output) / (tokens - 1), at the granularity the engines'
  outputs are polled), hit rate (cached prompt tokens the decoding engine reports over prompt
  tokens; disaggregated, the blocks received from the prefill engine count as cached)
  next to ``hit_rate_bound`` (what one unbounded cache would have hit with the same arrivals:
  full blocks of a prompt already sent, or of a finished turn's prompt and reply), requests
  routed per engine and their imbalance (max / mean over the decode engines), the router's
  predicted and obtained hit blocks; disaggregated: prefills, blocks transferred, the time the
  hand-overs took (mean wall time from asking the prefill engine for the blocks to the decode
  engine's queuing the request with them stored) and, with CUDA IPC, the rate
  of the decode engine's copies alone (bytes over their device time, CUDA events): the figure
  to hold against the measured GPU-to-GPU copy rate.
- ``--peer-bandwidth`` (2 CUDA GPUs): GPU0 -> GPU1 copies of 256 MiB in a spawned process,
  before any engine starts: the ceiling the KV transfer is compared with.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import json
import multiprocessing
import random
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from kvos.bench.serve import percentiles
from kvos.router.config import RouterConfig
from kvos.router.policies import ROUTERS

ROUTER_SETTINGS = ("kv_weight", "router_balance", "router_queue_weight", "router_shared_balance",
                   "router_shared_threshold", "router_sole_margin")
"""The ``RouterConfig`` fields every run shares (the router itself varies: --routers)."""


def add_args(p: argparse.ArgumentParser) -> None:
    from kvos.config.flags import add_config_args, positive

    p.add_argument("--conversations", type=int, default=200)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system-prompts", type=int, default=8, help="distinct shared system prompts")
    p.add_argument("--system-len", type=int, default=2048, help="tokens per system prompt")
    p.add_argument("--user-len", type=int, default=128, help="tokens per user message")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per turn (greedy, EOS ignored)")
    p.add_argument("--concurrency", type=int, default=64, help="conversations in flight at once (closed loop)")
    p.add_argument("--arrival-rate", type=positive(float), default=None, metavar="R",
                   help="open loop: conversations start at Poisson times, R per second (--concurrency unused)")
    p.add_argument("--data-parallel", type=int, default=2, metavar="N", help="engines behind each router")
    p.add_argument("--routers", default="kv_aware,round_robin,least_loaded",
                   help=f"comma-separated, one run each (of {', '.join(ROUTERS)})")
    add_config_args(p, RouterConfig, ROUTER_SETTINGS)
    p.add_argument("--prefill-decode", action="store_true",
                   help="one more run: 1 prefill engine + 1 decode engine (kv_aware)")
    p.add_argument("--transport", default="process", choices=["process", "ray"])
    p.add_argument("--kv-transfer", default="auto", choices=["auto", "host", "ipc", "p2p"],
                   help="disaggregated prefill's hand-over (DataParallelEngine.kv_transfer)")
    p.add_argument("--peer-bandwidth", action="store_true", help="measure GPU0 -> GPU1 copy GB/s (2 CUDA GPUs)")
    p.add_argument("--vocab-size", type=int, default=None, help="default: the model's")
    p.add_argument("--warmup-requests", type=int, default=4)
    p.add_argument("--bench-seed", type=int, default=0)
    p.add_argument("--output", default="benchmarks/results/fleet.json")


# -- workload -------------------------------------------------------------------------------
@dataclass
class Workload:
    systems: list[list[int]]
    users: list[list[list[int]]]
    """``users[c][k]``: conversation c's user message at turn k."""
    warmup: list[list[int]]


def make_workload(a: argparse.Namespace, vocab: int) -> Workload:
    """Random ids in [100, vocab - 100), seeded: the same prompts for every run."""
    rng = random.Random(a.bench_seed)

    def ids(n: int, r: random.Random = rng) -> list[int]:
        return [r.randrange(100, vocab - 100) for _ in range(n)]

    systems = [ids(a.system_len) for _ in range(a.system_prompts)]
    users = [[ids(a.user_len) for _ in range(a.turns)] for _ in range(a.conversations)]
    warm = random.Random(a.bench_seed + 1_000_003)
    return Workload(systems, users, [ids(a.system_len + a.user_len, warm) for _ in range(a.warmup_requests)])


def model_vocab_size(kw: dict) -> int:
    """The vocabulary size from the model's config (no weights loaded)."""
    from kvos.models.config import ModelConfig
    from kvos.models.loader import resolve_config_path, resolve_model_path

    if kw.get("random_weights"):
        path = resolve_config_path(kw.get("model"))
        return ModelConfig.from_hf(json.loads(path.read_text())).vocab_size
    path = resolve_model_path(kw.get("model"))
    if path.is_dir():
        return ModelConfig.from_hf(json.loads((path / "config.json").read_text())).vocab_size
    from kvos.models.gguf_header import open_gguf, read_gguf_config

    return read_gguf_config(open_gguf(path), path).vocab_size


class PrefixBound:
    """Full blocks one unbounded cache would hold: those of every prompt sent, and of every
    finished turn's prompt and reply (less the last token, which is never computed)."""

    def __init__(self, block_size: int) -> None:
        self.bs = block_size
        self.seen: set = set()

    def _keys(self, ids: list[int]) -> list:
        keys, key = [], None
        for i in range(0, len(ids) - self.bs + 1, self.bs):
            key = hash((key, tuple(ids[i: i + self.bs])))
            keys.append(key)
        return keys

    def hit_tokens(self, prompt: list[int]) -> int:
        """Tokens of ``prompt`` cached before it (as the engines count: its last token excluded),
        then record its blocks."""
        keys = self._keys(prompt[:-1])
        n = next((i for i, k in enumerate(keys) if k not in self.seen), len(keys))
        self.seen.update(keys)
        return n * self.bs

    def add(self, ids: list[int]) -> None:
        self.seen.update(self._keys(ids))


# -- one fleet --------------------------------------------------------------------------------
async def one_request(dp, params, rid: str, prompt: list[int], bound: PrefixBound | None) -> tuple[dict, list[int]]:
    """Submit one request and stream it to the end: its record (TTFT from the ``submit`` call to
    the first output with tokens; TPOT from there to the last output) and the reply's tokens."""
    rec = {"id": rid, "prompt_tokens": len(prompt), "bound_tokens": bound.hit_tokens(prompt) if bound else 0}
    t0 = time.perf_counter()
    stream = await dp.submit({"prompt_token_ids": prompt}, params, rid)
    first = last = None
    out = None
    async for out in stream:
        if out.outputs[0].token_ids:
            last = time.perf_counter()
            first = first or last
    if out is None or first is None or last is None:
        raise RuntimeError(f"request {rid} finished with no tokens")
    reply = list(out.outputs[0].token_ids)
    n = len(reply)
    rec.update(engine=out.metrics.get("engine"), cached_tokens=out.num_cached_tokens, output_tokens=n,
               ttft_s=first - t0, tpot_s=(last - first) / (n - 1) if n > 1 else None)
    return rec, reply


async def warm_up(dp, wl: Workload, params) -> list[int]:
    """The warm-up requests, submitted one after another (each counted in its engine's load
    before the next is routed, so a load-aware router spreads them) and run together; the
    requests each engine got."""
    before = list(dp.router_stats.routed)
    streams = [await dp.submit({"prompt_token_ids": p}, params, f"warmup-{i}") for i, p in enumerate(wl.warmup)]
    await asyncio.gather(*(s.result() for s in streams))
    routed = [x - y for x, y in zip(dp.router_stats.routed, before)]
    if wl.warmup and 0 in routed:
        print(f"  warning: the warm-up reached engines {routed} (requests each); an engine without any "
              "is warmed up by the timed requests", flush=True)
    return routed


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """Start times (seconds from 0) of ``n`` conversations arriving as a Poisson process of
    ``rate`` per second: the first at 0, then exponential gaps of mean ``1 / rate``; the same
    ``seed`` gives the same times."""
    if not rate > 0:
        raise ValueError(f"arrival_rate must be positive, got {rate!r}")
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


async def drive(dp, wl: Workload, a: argparse.Namespace, params) -> tuple[list[dict], float]:
    """Every conversation, ``--concurrency`` at once or starting at ``--arrival-rate``'s times,
    each turn after the previous one's reply; per-request records and the wall seconds."""
    bound = PrefixBound(dp.block_size)
    records: list[dict] = []
    starts = arrival_times(len(wl.users), a.arrival_rate, a.bench_seed + 2) if a.arrival_rate is not None else None
    sem = asyncio.Semaphore(a.concurrency) if starts is None else contextlib.nullcontext()
    t0 = time.perf_counter()

    async def conversation(c: int) -> None:
        if starts is not None:
            await asyncio.sleep(max(0.0, t0 + starts[c] - time.perf_counter()))
        async with sem:
            history = list(wl.systems[c % len(wl.systems)])
            for k, user in enumerate(wl.users[c]):
                prompt = history + user
                rec, reply = await one_request(dp, params, f"c{c}-t{k}", prompt, bound)
                records.append({"conversation": c, "turn": k, **rec})
                history = prompt + reply
                bound.add(history[:-1])

    await asyncio.gather(*(conversation(c) for c in range(len(wl.users))))
    return records, time.perf_counter() - t0


def _diff(after: dict, before: dict) -> dict:
    """The router's counts since ``before`` (lists element by element)."""
    def d(k: str, v):
        if isinstance(v, list):
            return [x - y for x, y in zip(v, before.get(k, [0] * len(v)))]
        return v - before.get(k, 0) if isinstance(v, (int, float)) and not isinstance(v, bool) else v
    return {k: d(k, v) for k, v in after.items()}


async def run_fleet(kw: dict, wl: Workload, a: argparse.Namespace, router: str, num_engines: int,
                    prefill_engines: int) -> dict:
    """Start a fleet, warm it up, drive the workload through it, stop it; the run's figures."""
    from kvos.core.sampling_params import SamplingParams
    from kvos.distributed.dp_engine import DataParallelEngine

    params = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    from kvos.config.flags import config_kwargs

    rc = RouterConfig(router, **config_kwargs(a, RouterConfig, ROUTER_SETTINGS))
    dp = DataParallelEngine(kw, num_engines, rc, prefill_engines=prefill_engines, transport=a.transport,
                            kv_transfer=a.kv_transfer)
    startup = time.perf_counter() - t0
    dp.start()
    try:
        longest = a.system_len + a.turns * (a.user_len + a.max_tokens)
        if longest > dp.max_model_len:
            raise ValueError(f"the last turn needs {longest} tokens; max_model_len is {dp.max_model_len}")
        warm = await warm_up(dp, wl, params)
        before = copy.deepcopy(vars(dp.router_stats))
        records, wall = await drive(dp, wl, a, params)
        router_stats = _diff(vars(dp.router_stats), before)
        engines = [await dp.engines.call(i, "stats") for i in range(len(dp.engines))]
    finally:
        await dp.stop_polling()
        dp.shutdown()
    label = f"{num_engines} x DP {router}" if not prefill_engines else f"{prefill_engines}P + {num_engines}D {router}"
    return {"label": label, "router": router, "decode_engines": num_engines, "prefill_engines": prefill_engines,
            "startup_s": startup, "warmup_routed": warm, "kv_transfer": dp.kv_transfer, **summarize(records, wall, router_stats, engines, num_engines),
            "records": records}


def summarize(records: list[dict], wall: float, router: dict, engines: list[dict], num_decode: int) -> dict:
    """The run's figures from its request records, the router's counts over the timed part and
    each engine's stats at the end."""
    prompt = sum(r["prompt_tokens"] for r in records)
    out_tokens = sum(r["output_tokens"] for r in records)
    routed = router["routed"][:num_decode]
    mean = sum(routed) / len(routed)
    res = {"wall_s": wall, "requests": len(records), "output_tokens": out_tokens,
           "output_tok_s": out_tokens / wall, "requests_s": len(records) / wall,
           "hit_rate": sum(r["cached_tokens"] for r in records) / prompt,
           "hit_rate_bound": sum(r["bound_tokens"] for r in records) / prompt,
           "ttft_s": percentiles([r["ttft_s"] for r in records]),
           "tpot_s": percentiles([r["tpot_s"] for r in records if r["tpot_s"] is not None]),
           "imbalance": max(routed) / mean if mean else None,
           "router": router,
           "engines": [{k: v for k, v in s.items() if not isinstance(v, (dict, list))} for s in engines]}
    if router["prefills"]:
        # bytes: the router's own count where it has one (rows passing through the front end),
        # else the blocks stored times the engines' page_bytes (one block, every layer, K and V)
        block_bytes = engines[0].get("page_bytes")
        moved = router.get("transferred_bytes") or (router["transferred_blocks"] * block_bytes if block_bytes else None)
        res["transfer"] = {"prefills": router["prefills"], "blocks": router["transferred_blocks"],
                           "seconds": router["transfer_s"], "block_bytes": block_bytes,
                           "bytes_from": "router" if router.get("transferred_bytes") else "blocks x page_bytes",
                           "gb": moved / 1e9 if moved else None,
                           "gb_s": moved / 1e9 / router["transfer_s"] if moved and router["transfer_s"] else None,
                           "handover_ms_mean": router["transfer_s"] / router["prefills"] * 1e3}
        copied = sum(e.get("adopt_copy_bytes", 0) for e in engines)
        copy_s = sum(e.get("adopt_copy_s", 0.0) for e in engines)
        if copied and copy_s:  # CUDA IPC: the decode engine's copies alone, on its device clock
            by_size: dict[str, dict] = {}
            for e in engines:
                for k, (n, b, t) in e.get("adopt_copies_by_size", {}).items():
                    row = by_size.setdefault(k, {"copies": 0, "bytes": 0, "seconds": 0.0})
                    row["copies"] += n
                    row["bytes"] += b
                    row["seconds"] += t
            for row in by_size.values():
                row["gb_s"] = row["bytes"] / 1e9 / row["seconds"] if row["seconds"] else None
            warm_b = sum(e.get("adopt_warm_bytes", 0) for e in engines)
            warm_s = sum(e.get("adopt_warm_s", 0.0) for e in engines)
            res["transfer"].update(device_copy_gb=copied / 1e9, device_copy_s=copy_s,
                                   device_copy_gb_s=copied / 1e9 / copy_s, device_copies_by_size=by_size,
                                   device_copy_gb_s_spread=[e.get("adopt_copy_gb_s_spread", {}) for e in engines
                                                            if e.get("adopt_copy_bytes")],
                                   warm_reads=sum(e.get("adopt_warm_copies", 0) for e in engines),
                                   warm_s=warm_s,
                                   device_copy_gb_s_with_warm=(copied + warm_b) / 1e9 / (copy_s + warm_s))
        # p2p: rank 0's pulls over NCCL/gloo, wall time of each (the sender's answer in it), less
        # each channel's first (which makes the channel)
        pulled = sum(e.get("p2p_received_bytes", 0) - e.get("p2p_setup_bytes", 0) for e in engines)
        pull_s = sum(e.get("p2p_received_s", 0.0) - e.get("p2p_setup_s", 0.0) for e in engines)
        if pulled and pull_s:
            res["transfer"].update(p2p_gb=pulled / 1e9, p2p_s=pull_s, p2p_gb_s=pulled / 1e9 / pull_s,
                                   p2p_setup_s=sum(e.get("p2p_setup_s", 0.0) for e in engines))
    return res


# -- GPU to GPU -------------------------------------------------------------------------------
def peer_copy_bandwidth(copies: int = 8, mib: int = 256) -> dict:
    """GB/s of ``copies`` GPU0 -> GPU1 copies of ``mib`` MiB after two warm-up copies
    (``synchronize`` on both and ``perf_counter`` around them). Run it in a process of its own."""
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n < 2:
        return {"skipped": f"needs 2 CUDA GPUs; {n} visible"}
    src = torch.empty(mib << 20, dtype=torch.uint8, device="cuda:0")
    dst = torch.empty(mib << 20, dtype=torch.uint8, device="cuda:1")

    def sync() -> None:
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)

    for _ in range(2):
        dst.copy_(src)
    sync()
    t0 = time.perf_counter()
    for _ in range(copies):
        dst.copy_(src, non_blocking=True)
    sync()
    dt = time.perf_counter() - t0
    return {"gb_s": copies * src.numel() / dt / 1e9, "copies": copies, "mib": mib, "seconds": dt,
            "peer_access": torch.cuda.can_device_access_peer(0, 1),
            "gpus": [torch.cuda.get_device_name(i) for i in range(2)]}


def _peer(a: argparse.Namespace) -> dict | None:
    if not a.peer_bandwidth:
        return None
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(peer_copy_bandwidth).result()


# -- report -----------------------------------------------------------------------------------
def table(runs: list[dict], peer: dict | None) -> str:
    ms = lambda d, q: f"{d[q] * 1e3:,.1f}" if q in d else "-"  # noqa: E731
    lines = ["| run | wall s | out tok/s | hit rate (bound) | TTFT p50 / p90 / p99 ms | TPOT p50 / p90 ms "
             "| routed | imbalance | predicted / obtained blocks | transfer |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        t, rs = r.get("transfer"), r["router"]
        if t is None:
            xfer = "-"
        elif t["gb_s"] is not None:
            xfer = (f"{t['blocks']} blocks, {t['gb']:.3f} GB; hand-over {t['handover_ms_mean']:.1f} ms mean"
                    + (f"; device copies {t['device_copy_gb_s']:.1f} GB/s, {t['device_copy_gb_s_with_warm']:.1f} "
                       f"with the {t['warm_reads']} link-waking reads" if "device_copy_gb_s" in t else ""))
        else:
            xfer = f"{t['blocks']} blocks in {t['seconds']:.2f} s"
        imb = "-" if r["imbalance"] is None else f"{r['imbalance']:.2f}"
        lines.append(f"| {r['label']} | {r['wall_s']:.1f} | {r['output_tok_s']:,.1f} "
                     f"| {r['hit_rate']:.1%} ({r['hit_rate_bound']:.1%}) "
                     f"| {ms(r['ttft_s'], 'p50')} / {ms(r['ttft_s'], 'p90')} / {ms(r['ttft_s'], 'p99')} "
                     f"| {ms(r['tpot_s'], 'p50')} / {ms(r['tpot_s'], 'p90')} "
                     f"| {' / '.join(map(str, rs['routed']))} | {imb} "
                     f"| {rs['predicted_hit_blocks']} / {rs['obtained_hit_blocks']} | {xfer} |")
    lines.append("(hit rate: cached prompt tokens / prompt tokens, as the engine that decodes reports them: with a "
                 "prefill engine, its transferred blocks count; bound: one unbounded cache, same arrivals. "
                 "routed: requests per engine, decode engines first)")
    if peer is not None:
        lines.append(f"GPU0 -> GPU1 copy: {peer['gb_s']:.1f} GB/s" if "gb_s" in peer else f"GPU0 -> GPU1: {peer['skipped']}")
    return "\n".join(lines)


def run(a: argparse.Namespace) -> dict:
    from kvos.bench.machine import machine_info
    from kvos.config.flags import engine_kwargs

    routers = [r.strip() for r in a.routers.split(",") if r.strip()]
    bad = [r for r in routers if r not in ROUTERS]
    if bad:
        raise ValueError(f"routers: {bad} not among {', '.join(ROUTERS)}")
    kw = {**engine_kwargs(a), "skip_tokenizer_init": True}
    vocab = a.vocab_size or model_vocab_size(kw)
    wl = make_workload(a, vocab)
    peer = _peer(a)
    fleets = [(r, a.data_parallel, 0) for r in routers] + ([("kv_aware", 1, 1)] if a.prefill_decode else [])
    runs = []
    for router, decode, prefill in fleets:
        print(f"fleet: {decode} decode + {prefill} prefill engines, router {router}", flush=True)
        runs.append(asyncio.run(run_fleet(kw, wl, a, router, decode, prefill)))
        r = runs[-1]
        print(f"  {r['output_tok_s']:,.1f} output tok/s, hit rate {r['hit_rate']:.1%}, "
              f"TTFT p50 {r['ttft_s']['p50'] * 1e3:,.1f} ms", flush=True)
    print(table(runs, peer))
    args = {k: v for k, v in vars(a).items() if isinstance(v, (str, int, float, bool, list, tuple, type(None)))}
    summary = {r["label"]: {"output_tok_s": round(r["output_tok_s"], 1), "hit_rate": round(r["hit_rate"], 4),
                            "ttft_p50_ms": round(r["ttft_s"]["p50"] * 1e3, 1),
                            "ttft_p90_ms": round(r["ttft_s"]["p90"] * 1e3, 1),
                            "tpot_p50_ms": round(r["tpot_s"].get("p50", 0) * 1e3, 1),
                            **({"transfer_gb_s": r["transfer"]["gb_s"]} if r.get("transfer") else {})}
               for r in runs}
    if peer is not None:
        summary["peer_copy_gb_s"] = peer.get("gb_s")
    result = {"bench": "fleet", "machine": machine_info(), "args": args, "vocab_size": vocab,
              "peer_bandwidth": peer, "summary": summary, "runs": runs}
    out = Path(a.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"saved {out}")
    return result
