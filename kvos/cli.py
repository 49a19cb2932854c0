"""The ``kvos`` command: generate, chat, serve, top, plan, simulate, bench, export-tokenizer."""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

from kvos.config.flags import (
    add_config_args,
    add_engine_args,
    config_kwargs,
    engine_kwargs,
    positive,
)


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--stats", action="store_true", help="print the KV cache's figures")


def sampling_params(a: argparse.Namespace):
    from kvos import SamplingParams

    return SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p,
                          top_k=a.top_k, min_p=a.min_p, seed=a.seed, stop=a.stop)


def format_stats(stats: dict) -> str:
    lines = ["KV cache:",
             f"  blocks     {stats['total']} x {stats['block_size']} tokens ({stats['page_bytes']} B each, "
             f"{stats.get('kv_cache_dtype', '?')}): "
             f"used {stats['used']}, cached {stats['cached']}, free {stats['free']} (usage {stats['kv_usage']:.1%})",
             f"  prefix     {stats['prefix_hits_tokens']} of {stats['prefix_queries_tokens']} prompt tokens hit "
             f"({stats['prefix_hit_rate']:.1%})",
             f"  events     evictions {stats['evictions']}, preemptions {stats['preemptions']}, "
             f"recomputed tokens {stats['recomputed_tokens']}, copy-on-write {stats['cow_copies']}"]
    for t in stats.get("tiers", []):
        lines.append(f"  tier {t['name']:<5} {t['used_bytes'] / 2**20:,.1f} of {t['capacity_bytes'] / 2**20:,.0f} MiB, "
                     f"hits {t['hits_blocks']} blocks, stores {t['stores_blocks']}, checksum failures "
                     f"{t['checksum_failures']}, errors {t['errors']}")
    return "\n".join(lines)


def stream(engine, request_id: str) -> str:
    """Drive ``engine`` until ``request_id`` finishes, printing its text as it grows."""
    shown = ""
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id != request_id:
                continue
            text = out.outputs[0].text
            if text.startswith(shown):
                sys.stdout.write(text[len(shown):])
                sys.stdout.flush()
            shown = text
    sys.stdout.write("\n")
    return shown


def cmd_generate(a: argparse.Namespace) -> int:
    from kvos import LLM

    llm = LLM(**engine_kwargs(a))
    rid = llm.engine.add_request(a.prompt, sampling_params(a))
    stream(llm.engine, rid)
    if a.stats:
        print(format_stats(llm.stats()))
    return 0


def cmd_chat(a: argparse.Namespace) -> int:
    from kvos import LLM

    llm = LLM(**engine_kwargs(a))
    messages = [{"role": "system", "content": a.system}] if a.system else []
    print("kvos chat: type a message, /stats for the cache's figures, /exit to leave.")
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if line.strip() in ("/exit", "/quit"):
            break
        if line.strip() == "/stats":
            print(format_stats(llm.stats()))
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        ids = llm.chat_token_ids(messages)
        rid = llm.engine.add_request({"prompt_token_ids": ids}, sampling_params(a))
        reply = stream(llm.engine, rid)
        messages.append({"role": "assistant", "content": reply})
        if a.stats:
            print(format_stats(llm.stats()))
    return 0


def cmd_bench(a: argparse.Namespace) -> int:
    result = a.bench_run(a)
    print(json.dumps(result["summary"], indent=2))
    return 0


def mask_key(key: str) -> str:
    """An API key as the banner shows it: never the key itself, at most its last 4 characters of
    a long key (``sk-...abcd``), else ``***``."""
    return f"{key[:3]}...{key[-4:]}" if len(key) >= 20 else "***"


def usage_banner(host: str, port: int, model: str, api_key: str | None, chat: bool = True,
                 token_ids: bool = False) -> str:
    """How to call the server: a chat example, or a plain completion for a base model (no chat
    template), or one with token ids (``token_ids``: no tokenizer). The API key is masked: the
    banner goes to logs."""
    api_key = mask_key(api_key) if api_key else None
    auth = f' -H "Authorization: Bearer {api_key}"' if api_key else ""
    if token_ids:
        route, body = "completions", f'{{"model": "{model}", "prompt": [1, 2, 3, 4], "max_tokens": 16}}'
        call = f"""client.completions.create(model="{model}",
        prompt=[1, 2, 3, 4], max_tokens=16).choices[0].model_extra["token_ids"]"""
    elif chat:
        route, body = "chat/completions", f'{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}], "max_tokens": 64}}'
        call = f"""client.chat.completions.create(model="{model}",
        messages=[{{"role": "user", "content": "Hello!"}}]).choices[0].message.content"""
    else:
        route, body = "completions", f'{{"model": "{model}", "prompt": "The capital of France is", "max_tokens": 16}}'
        call = f"""client.completions.create(model="{model}",
        prompt="The capital of France is", max_tokens=16).choices[0].text"""
    return f"""
kvos is serving {model} on http://{host}:{port}  (health: /health, metrics: /metrics)

  curl http://{host}:{port}/v1/{route}{auth} -H "Content-Type: application/json" \\
    -d '{body}'

  from openai import OpenAI
  client = OpenAI(base_url="http://{host}:{port}/v1", api_key="{api_key or 'none'}")
  print({call})
"""


def cmd_serve(a: argparse.Namespace) -> int:
    import logging

    import uvicorn

    from kvos.config import EngineConfig
    from kvos.engine.async_engine import AsyncEngine
    from kvos.engine.chat import has_chat_template
    from kvos.engine.llm_engine import LLMEngine
    from kvos.router.config import RouterConfig
    from kvos.serve.app import create_app
    from kvos.worker.device import resolve_device

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if a.decode_engines and not a.prefill_engines:
        raise SystemExit("--decode-engines needs --prefill-engines")
    if a.prefill_engines and a.data_parallel > 1:
        raise SystemExit("--data-parallel and --prefill-engines/--decode-engines exclude each other")
    several = a.data_parallel > 1 or bool(a.prefill_engines) or bool(a.encoder_engines)
    transport = a.transport
    if transport == "auto":
        cuda = resolve_device(str(a.device)).startswith("cuda")
        transport = ("ray" if a.ray_address or not cuda else "process") if several else "process" if cuda else "thread"
    if transport == "thread" and several:
        raise SystemExit("--transport thread runs one engine; several need ray or process")
    if getattr(a, "tensor_parallel_size", 1) > 1:
        if not several and a.transport != "process":
            transport = "thread"  # one engine: its ranks are processes of the server's engine
    if transport != "thread":
        from kvos.distributed import DataParallelEngine
        from kvos.models.loader import resolve_config_path, resolve_model_path

        kwargs = engine_kwargs(a)
        EngineConfig(**kwargs)  # bad options fail here, before any actor starts
        router = RouterConfig(**config_kwargs(a, RouterConfig))
        engine = DataParallelEngine(kwargs, (a.decode_engines or 1) if a.prefill_engines else a.data_parallel,
                                    router, a.ray_address, prefill_engines=a.prefill_engines or 0,
                                    transport=transport, engine_timeout_s=a.engine_timeout_s,
                                    max_restarts=a.engine_max_restarts, encoder_engines=a.encoder_engines or 0,
                                    kv_transfer=a.kv_transfer)
        model_path = (resolve_config_path if kwargs.get("random_weights") else resolve_model_path)(kwargs["model"])
    else:
        local = LLMEngine(EngineConfig(**engine_kwargs(a)))
        engine = AsyncEngine(local)  # the engine loop on a thread of this process
        model_path = local.model_path
    name = a.served_model_name or model_path.name.removesuffix(".gguf").split(".")[0]
    from kvos.serve.limits import DrainingServer, guarded_protocol

    app = create_app(engine, name, api_keys=a.api_key, max_waiting=a.max_waiting_requests,
                     warmup=not a.no_warmup, allowed_origins=a.allowed_origins,
                     max_request_bytes=a.max_request_bytes, shutdown_timeout_s=a.shutdown_timeout_s,
                     admin_key=a.admin_key or os.environ.get("KVOS_ADMIN_KEY"))
    print(usage_banner(a.host, a.port, name, (a.api_key or [None])[0], has_chat_template(engine.tokenizer),
                       token_ids=engine.tokenizer is None), flush=True)
    protocol = guarded_protocol(a.request_timeout_s, a.max_header_bytes)
    if protocol is None:
        logging.getLogger("kvos.serve").warning("httptools is not installed: no --request-timeout-s, and "
                                                "oversized headers get 400 rather than 431")
    config = uvicorn.Config(app, host=a.host, port=a.port, log_level="warning", http=protocol or "auto",
                            timeout_keep_alive=a.timeout_keep_alive, h11_max_incomplete_event_size=a.max_header_bytes,
                            # streams were drained (or cut) before uvicorn's own shutdown starts
                            timeout_graceful_shutdown=10)
    app.state.kvos.tool_call_parser = None if a.tool_call_parser == "auto" else a.tool_call_parser
    DrainingServer(config, app.state.kvos.drain).run()
    return 0


def cmd_top(a: argparse.Namespace) -> int:
    from kvos.serve.top import run

    return run(a.url, a.api_key, a.interval, a.once, a.top)


def cmd_export_tokenizer(a: argparse.Namespace) -> int:
    from pathlib import Path

    from kvos.models.loader import load_tokenizer, resolve_model_path

    tok = load_tokenizer(resolve_model_path(a.model))
    out = Path(a.out_dir)
    tok.save_pretrained(str(out))
    print(f"saved the tokenizer of {resolve_model_path(a.model).name} ({len(tok)} tokens) to {out}/")
    return 0


BENCHES = [  # (command, module in kvos.bench, help, takes the engine options)
    ("throughput", "throughput", "kvos vs HF transformers generate, and prefix-cache TTFT", True),
    ("serve", "serve", "HTTP load against a running server: TTFT, TPOT, throughput", False),
    ("tiers", "tiers", "later-turn TTFT: recompute vs loading from CPU, disk, Redis", False),
    ("tier-bandwidth", "tier_bandwidth", "CPU-tier block loads into device blocks vs pinned H2D copy", False),
    ("sampling", "sampling", "sampled decoding (top-k/top-p/min-p) vs greedy on the same requests", True),
    ("structured", "structured", "structured outputs (grammar masks) in a share of the batch vs free decoding", True),
    ("steps", "steps", "time real engine steps (a calibration file for kvos simulate)", True),
    ("hybrid", "hybrid", "hybrid KV layouts side by side: 32K-request capacity, waste, long-context tok/s", True),
    ("kv-speed", "kv_speed", "KV in the model's dtype vs 8 bits: tokens held, long-context tok/s, decode roofline", True),
    ("policies", "policies", "eviction policies vs the offline optimum on the Mooncake traces (simulated)", False),
    ("tier-parity", "tier_parity", "the engine's CPU tier vs the simulated tier, per eviction policy, on a scan trace", False),
    ("routing", "routing", "routers across 4-64 simulated engines: hit rate, TTFT, load imbalance (Mooncake)", False),
    ("fleet", "fleet", "several engines behind one router on multi-turn chats: hit rate, TTFT, throughput; prefill/decode transfer", True),
    ("speculative", "speculative", "one stream with and without speculation (n-gram or a draft model): tok/s, tokens per step, acceptance", True),
    ("cpu", "cpu_stream", "one CPU stream: kvos, kvos on float32 weights, transformers and llama.cpp on one GGUF", False),
    ("kv-quant", "kv_quant", "quantized KV accuracy vs the model's dtype: greedy agreement, logit error, perplexity", False),
    ("segments", "segments", "segment reuse on a RAG-style set vs full prefill: agreement, logit error, perplexity, TTFT", False),
    ("state-cache", "state_cache", "a Mamba hybrid: decode and prefill vs roofline, multi-turn TTFT with state prefix caching", True),
    ("tensor-parallel", "tensor_parallel", "one engine over several GPUs: decode vs roofline with the all-reduce measured, throughput", True),
    ("images", "images", "a vision-language model: encoder time vs roofline, TTFT with the encoder cache and image prefix hits", True),
    ("image-goodput", "image_goodput", "encoder engines (E/PD) vs engines encoding their own images: SLO goodput on an image-heavy workload", True),
    ("state-split", "state_split", "a Mamba hybrid's pool: requests held at once, elastic vs fixed state/KV splits", False),
]


def build_parser() -> argparse.ArgumentParser:
    """The ``kvos`` parser, every subcommand (each sets ``fn``, the function that runs it)."""
    from kvos.router.config import RouterConfig

    p = argparse.ArgumentParser(prog="kvos", description="LLM inference with the KV cache as virtual memory")
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="complete one prompt, streaming tokens")
    g.add_argument("prompt")
    add_engine_args(g)
    add_sampling_args(g)
    g.set_defaults(fn=cmd_generate)
    c = sub.add_parser("chat", help="interactive chat with the model's chat template")
    c.add_argument("--system", default=None, help="system prompt")
    add_engine_args(c)
    add_sampling_args(c)
    c.set_defaults(fn=cmd_chat)
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", action="append", default=None,
                   help="require 'Authorization: Bearer KEY' (repeatable; each key is a cache tenant)")
    s.add_argument("--served-model-name", default=None)
    s.add_argument("--tool-call-parser", choices=["auto", "hermes", "llama3_json"], default="auto",
                   help="how tool calls are read from replies: auto picks from the chat template (Hermes "
                        "<tool_call> tags when it does not render tools)")
    s.add_argument("--max-waiting-requests", type=int, default=256,
                   help="requests waiting for their first token beyond this get 429")
    s.add_argument("--no-warmup", action="store_true")
    s.add_argument("--allowed-origins", default=None, metavar="ORIGIN[,ORIGIN...]",
                   type=lambda v: importlib.import_module("kvos.serve.app").allowed_origins_arg(v),
                   help="turn CORS on for these browser origins (comma-separated, or '*' for any); off by default")
    from kvos.serve import defaults as limits

    lg = s.add_argument_group("limits and shutdown")
    lg.add_argument("--max-request-bytes", type=positive(int), default=limits.DEFAULT_MAX_REQUEST_BYTES,
                    help="request bodies larger than this get 413 before they are parsed (default: 8 MiB)")
    lg.add_argument("--max-header-bytes", type=positive(int), default=limits.DEFAULT_MAX_HEADER_BYTES,
                    help="a request line plus headers larger than this gets 431 (default: 32 KiB)")
    lg.add_argument("--request-timeout-s", type=positive(float), default=limits.DEFAULT_REQUEST_TIMEOUT_S,
                    help="a request whose headers and body have not all arrived this long after its first byte "
                         "(or the connection's start) gets 408 and its connection is closed (default: 30)")
    lg.add_argument("--timeout-keep-alive", type=positive(float), default=5.0,
                    help="close an idle keep-alive connection after this many seconds (default: 5)")
    lg.add_argument("--shutdown-timeout-s", type=float, default=limits.DEFAULT_SHUTDOWN_TIMEOUT_S,
                    help="on SIGTERM/SIGINT, wait this long for requests in flight, then end them (a stream gets an "
                         "error event and [DONE]); /health is 503 meanwhile (default: 30)")
    dp = s.add_argument_group("several engines (Ray, or local processes)")
    dp.add_argument("--data-parallel", type=positive(int), default=1, metavar="N",
                    help="N engine actors on a Ray cluster (one per GPU on a GPU host) behind one endpoint and a "
                         "router; with no cluster running, a local one is started")
    dp.add_argument("--prefill-engines", type=positive(int), default=None, metavar="P",
                    help="disaggregated prefill: P engines compute prompts and send their KV blocks to the decode "
                         "engines (--decode-engines), which generate")
    dp.add_argument("--encoder-engines", type=positive(int), default=None, metavar="E",
                    help="a vision-language model: E engines that only run the image encoder (E/PD); the "
                         "language engines receive encodings (docs/images.md)")
    dp.add_argument("--decode-engines", type=positive(int), default=None, metavar="D",
                    help="with --prefill-engines: D engines that generate (default 1)")
    dp.add_argument("--ray-address", default=None,
                    help="join this Ray cluster (e.g. auto, or HOST:6379 after 'ray start --head')")
    dp.add_argument("--transport", default="auto", choices=["auto", "ray", "process", "thread"],
                    help="where the engines run: Ray actors; local processes without Ray (one host; KV blocks of "
                         "disaggregated prefill move GPU to GPU by CUDA IPC); or, for one engine, a thread of the "
                         "server. auto: on a CUDA device, processes (ray with --ray-address); on the CPU, ray for "
                         "several engines and a thread for one")
    dp.add_argument("--kv-transfer", default="auto", choices=["auto", "host", "ipc", "p2p"],
                    help="how prefill engines hand KV blocks to decode engines: host rows through the front end, "
                         "CUDA IPC (processes of one GPU host), or p2p (each decode rank pulls its part over NCCL "
                         "send/recv; gloo on the CPU). auto: ipc for processes on GPUs, p2p for Ray engines on "
                         "GPUs, host otherwise")
    dp.add_argument("--engine-timeout-s", type=positive(float), default=30.0,
                    help="every call to an engine has this deadline (a poll: its wait plus this); an engine that "
                         "misses it takes no requests, its requests move or end, until it answers again")
    dp.add_argument("--engine-max-restarts", type=int, default=3, metavar="N",
                    help="an engine that dies is started again up to N times (then reported failed in /health)")
    dp.add_argument("--admin-key", default=None,
                    help="turn on /admin/engines (drain, resume, remove or add an engine) behind 'Authorization: "
                         "Bearer KEY' (or set KVOS_ADMIN_KEY)")
    add_config_args(s, RouterConfig)
    add_engine_args(s)
    s.set_defaults(fn=cmd_serve)
    tp = sub.add_parser("top", help="live view of a running server's KV memory: pages by group and state, hit "
                        "rates, top cached prefixes, tiers, engines, queue and throughput")
    tp.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default: http://127.0.0.1:8000)")
    tp.add_argument("--api-key", default=os.environ.get("KVOS_API_KEY"),
                    help="a key of a server started with --api-key (default: $KVOS_API_KEY)")
    tp.add_argument("--interval", type=positive(float), default=1.0, help="seconds between refreshes (default: 1)")
    tp.add_argument("--once", action="store_true",
                    help="print one view (two samples --interval apart, for the throughput) and exit")
    tp.add_argument("--top", type=int, default=10, choices=range(0, 101), metavar="N",
                    help="cached prefixes to list (0-100, default: 10)")
    tp.set_defaults(fn=cmd_top)
    et = sub.add_parser("export-tokenizer", help="save the model's tokenizer as a Hugging Face tokenizer folder "
                        "(for load tools such as guidellm: --tokenizer kind=huggingface_auto,model=DIR)")
    et.add_argument("out_dir")
    et.add_argument("--model", default=None, help="GGUF file or HF folder (default: SmolLM2-135M-Instruct)")
    et.set_defaults(fn=cmd_export_tokenizer)
    from kvos.sim import plan_cli

    pl = sub.add_parser("plan", help="capacity planner: KV bytes, pool, concurrency, decode roofline",
                        epilog=plan_cli.EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    plan_cli.add_args(pl)
    pl.set_defaults(fn=plan_cli.run)
    from kvos.sim import sim_cli

    sm = sub.add_parser("simulate", help="replay a trace through the real scheduler and KV memory system",
                        epilog=sim_cli.EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    sim_cli.add_args(sm)
    sm.set_defaults(fn=sim_cli.run)
    b = sub.add_parser("bench", help="benchmarks (each saves JSON with the machine)")
    bsub = b.add_subparsers(dest="bench", required=True)
    for name, module, help_, engine_options in BENCHES:
        mod = importlib.import_module(f"kvos.bench.{module}")
        sp = bsub.add_parser(name, help=help_)
        mod.add_args(sp)
        if engine_options:
            add_engine_args(sp)
        sp.set_defaults(fn=cmd_bench, bench_run=mod.run)
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        return a.fn(a)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
