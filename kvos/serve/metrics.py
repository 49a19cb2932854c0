"""Prometheus metrics, named after vLLM's under a ``kvos:`` prefix."""
from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

FINISH_REASONS = ("stop", "length", "abort", "error")
PROMPT_BUCKETS = (128, 512, 2048, 8192)
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0)


def prompt_bucket(n: int) -> str:
    """The prompt-length label: "0-128", "128-512", ..., "8192+"."""
    lo = 0
    for hi in PROMPT_BUCKETS:
        if n < hi:
            return f"{lo}-{hi}"
        lo = hi
    return f"{lo}+"


class _EngineCollector(Collector):
    """Reads the engine's cache and queue figures at scrape time."""

    def __init__(self, stats: Callable[[], dict]) -> None:
        self._stats = stats

    def collect(self) -> Iterator:
        s = self._stats()
        yield GaugeMetricFamily("kvos:kv_cache_usage_perc", "Fraction of KV blocks referenced by requests.",
                                value=s["kv_usage"])
        blocks = GaugeMetricFamily("kvos:kv_cache_blocks", "KV blocks by state.", labels=["state"])
        for state in ("free", "cached", "used"):
            blocks.add_metric([state], s[state])
        yield blocks
        groups = GaugeMetricFamily("kvos:kv_cache_group_blocks", "Blocks of each cache group (layer kind) by state.",
                                   labels=["group", "kind", "state"])
        for i, g in enumerate(s.get("groups", [])):
            for state in ("free", "cached", "used"):
                groups.add_metric([str(i), g["kind"], state], g[state])
        yield groups
        memory = s.get("memory")
        if memory is not None:
            yield GaugeMetricFamily("kvos:kv_cache_held_bytes", "KV bytes held for running requests "
                                    "(their blocks plus free small pages inside split large pages).",
                                    value=memory["held_bytes"])
            yield GaugeMetricFamily("kvos:kv_cache_waste_bytes", "Held KV bytes not holding live tokens "
                                    "(partial blocks, padding, tokens past a window, fragmentation).",
                                    value=memory["waste_bytes"])
            yield GaugeMetricFamily("kvos:kv_cache_waste_perc", "Fraction of held KV bytes that is waste.",
                                    value=memory["waste_fraction"])
        yield GaugeMetricFamily("kvos:num_requests_running", "Sequences in the running batch.", value=s["running"])
        yield GaugeMetricFamily("kvos:num_requests_waiting", "Sequences waiting to be scheduled.",
                                value=s["waiting"])
        yield GaugeMetricFamily("kvos:prefix_cache_hit_rate", "Prefix-cache hits / queries (tokens).",
                                value=s["prefix_hit_rate"])
        for name, key, doc in [
            ("kvos:prefix_cache_queries", "prefix_queries_tokens", "Prompt tokens looked up in the prefix cache."),
            ("kvos:prefix_cache_hits", "prefix_hits_tokens", "Prompt tokens found in the prefix cache."),
            ("kvos:kv_cache_evictions", "evictions", "Cached blocks evicted to make room."),
            ("kvos:num_preemptions", "preemptions", "Sequences preempted (recompute)."),
            ("kvos:recomputed_tokens", "recomputed_tokens", "Tokens computed again after preemption or eviction."),
            ("kvos:kv_cache_cow_copies", "cow_copies", "Copy-on-write block copies."),
            ("kvos:segment_hits", "segment_hits", "Segments whose KV was reused at another position."),
            ("kvos:segment_reused_tokens", "segment_reused_tokens", "Prompt tokens taken from reused segments."),
            ("kvos:segment_recomputed_tokens", "segment_recomputed_tokens",
             "Tokens of reused segments computed anyway (each segment's recomputed head)."),
            ("kvos:segment_fills", "segment_fills", "Segments computed alone to be cached, when first seen."),
            ("kvos:segment_saved_seconds", "segment_saved_seconds",
             "Prefill time segment reuse saved (estimated: reused tokens times recent seconds per prefill token)."),
            ("kvos:engine_steps", "steps", "Engine steps run (summed over engines)."),
            ("kvos:engine_step_seconds", "step_seconds", "Wall time inside engine steps (summed over engines)."),
            ("kvos:engine_batched_tokens", "batched_tokens", "Tokens the engine steps computed."),
            ("kvos:engine_failed_steps", "failed_steps",
             "Engine steps that raised; each failed the requests it held (finish reason \"error\")."),
        ]:
            yield CounterMetricFamily(name, doc, value=s.get(key, 0))
        yield CounterMetricFamily("kvos:tier_hit_tokens", "Prompt tokens loaded from tiers below the device.",
                                  value=s["tier_hits_tokens"])
        tiers = s.get("tiers", [])
        for name, key, doc, kind in [
            ("kvos:tier_usage_bytes", "used_bytes", "Bytes held by each tier.", GaugeMetricFamily),
            ("kvos:tier_capacity_bytes", "capacity_bytes", "Capacity of each tier.", GaugeMetricFamily),
            ("kvos:tier_hit_blocks", "hits_blocks", "Blocks loaded from each tier.", CounterMetricFamily),
            ("kvos:tier_load_bytes", "loads_bytes", "Bytes loaded from each tier.", CounterMetricFamily),
            ("kvos:tier_load_seconds", "load_seconds", "Time spent loading from each tier.", CounterMetricFamily),
            ("kvos:tier_store_bytes", "stores_bytes", "Bytes stored into each tier.", CounterMetricFamily),
            ("kvos:tier_store_seconds", "store_seconds", "Time spent storing into each tier.", CounterMetricFamily),
            ("kvos:tier_checksum_failures", "checksum_failures", "Blocks that failed their checksum.",
             CounterMetricFamily),
            ("kvos:tier_errors", "errors", "Tier I/O errors (e.g. Redis down).", CounterMetricFamily),
        ]:
            fam = kind(name, doc, labels=["tier"])
            for t in tiers:
                fam.add_metric([t["name"]], t[key])
            yield fam
        encoder = s.get("encoder")
        if encoder is not None:
            yield from _encoder_families(encoder)
        if s.get("encoder_engines") is not None:
            yield from _encoder_engine_families(s["encoder_engines"])
        spec = s.get("speculative")
        if spec is not None:
            yield from _spec_families(spec)
        yield from _engine_families(s.get("engines", []))
        router = s.get("router")
        if router is not None:
            yield from _router_families(router)


def _encoder_families(e: dict) -> Iterator:
    """A vision-language model's image encoder and its cache of encodings."""
    yield CounterMetricFamily("kvos:encoder_runs", "Image tiles run through a language engine's encoder (cache "
                              "misses not encoded by an encoder engine).", value=e["encoder_runs"])
    yield CounterMetricFamily("kvos:encodings_received", "Encodings an encoder engine computed, stored by a "
                              "language engine.", value=e.get("encodings_received", 0))
    yield CounterMetricFamily("kvos:encoder_cache_hits", "Images whose encoding came from the encoder cache.",
                              value=e["encoder_cache_hits"])
    yield CounterMetricFamily("kvos:encoder_cache_evictions", "Encodings evicted to make room.",
                              value=e["encoder_cache_evictions"])
    yield GaugeMetricFamily("kvos:encoder_cache_bytes", "Device bytes held by cached encodings.",
                            value=e["encoder_cache_bytes"])
    yield GaugeMetricFamily("kvos:encoder_cache_capacity_bytes", "The encoder cache's size (--encoder-cache-mb).",
                            value=e["encoder_cache_capacity_bytes"])


def _encoder_engine_families(e: dict) -> Iterator:
    """Encoder engines (E/PD): tiles they encoded, their time, failures, and how many are up."""
    yield CounterMetricFamily("kvos:encoder_engine_runs", "Image tiles encoded on encoder engines.",
                              value=e["encoder_engine_runs"])
    yield CounterMetricFamily("kvos:encoder_engine_seconds", "Wall time of encoder engines' calls, seen by the "
                              "front end.", value=e["encoder_engine_seconds"])
    yield CounterMetricFamily("kvos:encoder_engine_failures", "Encoder engine calls that failed or timed out.",
                              value=e["encoder_engine_failures"])
    yield GaugeMetricFamily("kvos:encoder_engines_up", "Encoder engines taking work.", value=e["up"])


def _spec_families(spec: dict) -> Iterator:
    """Speculative decoding's counters (vLLM's ``spec_decode_*`` names)."""
    for name, key, doc in [
        ("kvos:spec_decode_num_drafts", "verified_seqs", "Sequences that verified drafts (one per verify)."),
        ("kvos:spec_decode_num_draft_tokens", "proposed", "Draft tokens proposed and verified."),
        ("kvos:spec_decode_num_accepted_tokens", "accepted", "Draft tokens the target accepted."),
        ("kvos:spec_decode_draft_seconds", "draft_seconds", "Time spent proposing drafts."),
        ("kvos:spec_decode_verify_seconds", "verify_seconds", "Time spent in speculative (verify) steps."),
        ("kvos:spec_decode_skipped_for_load", "skipped_for_load",
         "Steps that ran without drafts because the batch exceeded disable_by_batch_size."),
    ]:
        yield CounterMetricFamily(name, doc, value=spec[key])
    per_pos = CounterMetricFamily("kvos:spec_decode_num_accepted_tokens_per_pos",
                                  "Draft tokens accepted at each position.", labels=["position"])
    for i, n in enumerate(spec.get("accepted_by_position", [])):
        per_pos.add_metric([str(i)], n)
    yield per_pos
    yield GaugeMetricFamily("kvos:spec_decode_acceptance_rate", "Accepted / proposed draft tokens.",
                            value=spec["acceptance_rate"])
    yield GaugeMetricFamily("kvos:spec_decode_mean_accepted_length",
                            "Tokens each verify yields per sequence (1 + accepted drafts).",
                            value=spec["mean_accepted_length"])


def _engine_families(engines: list[dict]) -> Iterator:
    """Per-engine figures of a data-parallel server (label ``engine``)."""
    if not engines:
        return
    info = GaugeMetricFamily("kvos:engine_info", "Each engine's process (1 per engine).", labels=["engine", "pid"])
    for e in engines:
        info.add_metric([str(e["engine"]), str(e.get("pid", ""))], 1)
    yield info
    for name, key, doc, kind in [
        ("kvos:engine_up", "up", "1 while the engine answers, 0 while it is down.", GaugeMetricFamily),
        ("kvos:engine_num_requests_running", "running", "Sequences running on the engine.", GaugeMetricFamily),
        ("kvos:engine_num_requests_waiting", "waiting", "Sequences waiting on the engine.", GaugeMetricFamily),
        ("kvos:engine_kv_cache_usage_perc", "kv_usage", "Fraction of the engine's KV blocks in use.",
         GaugeMetricFamily),
        ("kvos:engine_prefix_cache_queries", "prefix_queries_tokens", "Prompt tokens looked up on the engine.",
         CounterMetricFamily),
        ("kvos:engine_prefix_cache_hits", "prefix_hits_tokens", "Prompt tokens found in the engine's cache.",
         CounterMetricFamily),
    ]:
        fam = kind(name, doc, labels=["engine"])
        for e in engines:
            if key in e:
                fam.add_metric([str(e["engine"])], float(e[key]))
        yield fam


def _router_families(r: dict) -> Iterator:
    routed = CounterMetricFamily("kvos:router_requests", "Requests the router sent to each engine.",
                                 labels=["engine", "policy"])
    for i, n in enumerate(r["routed"]):
        routed.add_metric([str(i), r["policy"]], n)
    yield routed
    for name, key, doc in [
        ("kvos:router_predicted_hit_blocks", "predicted_hit_blocks",
         "Prompt blocks the router expected the chosen engine to hold."),
        ("kvos:router_obtained_hit_blocks", "obtained_hit_blocks", "Prompt blocks the chosen engine served."),
        ("kvos:router_prompt_blocks", "prompt_blocks", "Full prompt blocks of routed requests."),
        ("kvos:router_retried_requests", "retried", "Requests moved to another engine after a failure."),
        ("kvos:router_cut_requests", "cut", "Streams ended because their engine failed."),
        ("kvos:router_engine_failures", "engine_failures", "Engines found dead."),
        ("kvos:router_resyncs", "resyncs", "KV event gaps resolved from a snapshot."),
        ("kvos:router_prefills", "prefills", "Requests prefilled on a prefill engine (disaggregated)."),
        ("kvos:router_transferred_blocks", "transferred_blocks", "KV blocks moved from prefill to decode engines."),
        ("kvos:router_transfer_seconds", "transfer_s", "Time spent moving KV blocks to decode engines."),
        ("kvos:router_transferred_bytes", "transferred_bytes", "KV bytes moved to decode engines (where counted)."),
        ("kvos:router_encoder_routed", "encoder_routed",
         "Requests sent, against the router's choice, to the engine holding their images' encodings."),
    ]:
        yield CounterMetricFamily(name, doc, value=r[key])


class ServerMetrics:
    """Per-app registry: engine figures plus request latency histograms."""

    def __init__(self, stats: Callable[[], dict]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(stats))
        r = self.registry
        self.ttft = Histogram("kvos:time_to_first_token_seconds", "Time to first token.",
                              ["prompt_len_bucket"], buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("kvos:time_per_output_token_seconds", "Time per output token after the first.",
                              ["prompt_len_bucket"], buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("kvos:e2e_request_latency_seconds", "End-to-end request latency.",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("kvos:prompt_tokens", "Prompt tokens processed.", registry=r)
        self.generation_tokens = Counter("kvos:generation_tokens", "Tokens generated.", registry=r)
        self.requests = Counter("kvos:request_success", "Finished requests by reason.", ["finished_reason"],
                                registry=r)
        for reason in FINISH_REASONS:  # present at 0 from the start, as Prometheus advises for known labels
            self.requests.labels(reason)
        self.rejected = Counter("kvos:request_rejected", "Requests refused by status code.", ["code"], registry=r)

    def observe(self, prompt_len: int, arrival: float, first: float | None, end: float, num_out: int,
                reason: str) -> None:
        bucket = prompt_bucket(prompt_len)
        if first is not None:
            self.ttft.labels(bucket).observe(first - arrival)
            if num_out > 1:
                self.tpot.labels(bucket).observe((end - first) / (num_out - 1))
        self.e2e.observe(end - arrival)
        self.prompt_tokens.inc(prompt_len)
        self.generation_tokens.inc(num_out)
        self.requests.labels(reason).inc()
