"""The engine's one configuration object."""
from __future__ import annotations

from dataclasses import dataclass, field, fields

from kvos.cache.eviction import EVICTION_POLICIES, online_policies
from kvos.cache.tiers.hierarchy import WRITE_POLICIES
from kvos.config.generation import GENERATION_CONFIGS, parse_override
from kvos.scheduler.policies import VICTIM_ORDERS, WAITING_POLICIES
from kvos.scheduler.scheduler import SchedulerConfig
from kvos.scheduler.segments import SEGMENT_HEADERS
from kvos.spec.config import SpeculativeConfig

KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "int8")
KV_LAYOUTS = ("unified", "equal_pages", "homogeneous")
PREEMPTION_MODES = ("recompute", "swap")
TIER_VERIFY = ("auto", "host", "device")
TIERS = "tiers below the device"  # the CLI's argument group for these fields
IMAGES = "images (vision-language models)"

# Each field's metadata drives its ``kvos`` flag (kvos.config.flags.add_config_args): "help", "choices" (a
# tuple, or a registry read when the parser is built), and where the default spelling (--field-name) does not
# fit, "flag", "aliases", "dest", "negate" (a bool flag that turns the field off), "group" (the help section;
# default "engine"). The policies' choices are their registries' names; the scheduler's fields take their
# defaults from SchedulerConfig (one default each).


@dataclass
class EngineConfig:
    """Everything that shapes an engine. Sizes are in tokens unless named ``_bytes``.

    The KV pool holds ``num_blocks`` pages if given (blocks of a single-group model; large pages
    of a hybrid model's pool, see ``kv_layout``), else as many as fit in
    ``kv_cache_memory_bytes``; when neither is given, 2 GiB on the CPU and, on a GPU, what is
    left of ``gpu_memory_utilization`` of its memory after the weights and the peak activations
    of a profiled ``max_num_batched_tokens`` step. ``max_model_len`` defaults to the model's
    context length. ``random_weights``: ``model`` names a config (bundled name, config.json or
    folder) and weights are drawn at random on the device (benchmarks of shapes whose weights
    are not at hand). ``enforce_eager``: no CUDA graphs on a GPU. ``async_scheduling``
    (default: on a GPU): step N+1 is scheduled and queued while step N runs, so host work
    (scheduling, inputs, outputs) overlaps the device; outputs then arrive one step later and a
    sequence that stops on a token runs one extra step whose token is dropped.
    ``kv_cache_dtype``: ``auto`` keeps K/V in the model's dtype; ``fp8_e4m3`` and ``int8`` store
    one byte per value plus a float32 scale per (token, layer, K/V, kv head), about half of
    bf16's bytes (a quarter of float32's), quantized on write and dequantized inside attention.
    """

    model: str | None = field(default=None, metadata={
        "aliases": ("--config",),
        "help": "GGUF file or HF folder (default: SmolLM2-135M-Instruct); with --random-weights a bundled config "
                "(llama-3.1-8b, qwen3-8b, bamba-9b, llama-tiny, qwen3-tiny) or a config.json"})
    block_size: int = field(default=16, metadata={"help": "tokens per KV block"})
    kv_layout: str = field(default="unified", metadata={
        "choices": KV_LAYOUTS,
        "help": "hybrid (sliding-window) models: one pool of LCM-sized pages split per layer kind "
                "(unified, Jenga), vLLM-style equal pages, or every layer keeping every token (homogeneous)"})
    mamba_cache_every: int | None = field(default=None, metadata={
        "help": "models with Mamba layers: keep a prefill's recurrent state at every Nth block boundary for "
                "prefix caching (default: as many blocks as hold one state page's bytes of KV; 16 without "
                "attention layers)"})
    enable_prefix_caching: bool = field(default=True, metadata={
        "flag": "--no-prefix-caching", "negate": True, "help": "turn automatic prefix caching off"})
    kv_cache_memory_bytes: int | None = field(default=None, metadata={
        "help": "KV pool budget (default: 2 GiB on CPU; on a GPU, profiled from --gpu-memory-utilization)"})
    num_blocks: int | None = field(default=None, metadata={
        "help": "pool size in pages: blocks, or large pages of a hybrid pool (overrides the budget)"})
    max_num_batched_tokens: int = field(default=SchedulerConfig.max_num_batched_tokens, metadata={
        "help": "tokens one engine step may schedule"})
    max_num_seqs: int = field(default=SchedulerConfig.max_num_seqs, metadata={
        "help": "sequences one engine step may run"})
    max_model_len: int | None = field(default=None, metadata={
        "help": "longest sequence, prompt and output (default: the model's context length)"})
    dtype: str | None = field(default=None, metadata={"help": "default: bfloat16 on a GPU, float32 on the CPU"})
    kv_cache_dtype: str = field(default="auto", metadata={
        "choices": KV_CACHE_DTYPES,
        "help": "KV cache storage: the model's dtype (auto), or 8-bit with a float32 scale per token "
                "and kv head (about half of bf16's bytes)"})
    device: str = field(default="auto", metadata={
        "help": "torch device, e.g. cpu or cuda; auto: cuda when a GPU is visible, else cpu"})
    scheduling_policy: str = field(default=SchedulerConfig.scheduling_policy, metadata={
        "choices": WAITING_POLICIES,
        "help": "fcfs: arrival order; priority: lower value first; lpm: longest cached prefix first"})
    fairness_steps: int = field(default=SchedulerConfig.fairness_steps, metadata={
        "help": "lpm: a request overtaken by later arrivals for this many steps goes first"})
    eviction_policy: str = field(default="lru", metadata={
        "choices": online_policies,
        "help": "which unreferenced cached block is evicted first (the simulator also takes belady, the offline "
                "optimum)"})
    eviction_lookahead: int = field(default=SchedulerConfig.eviction_lookahead, metadata={
        "help": "cached prefixes that the next N waiting requests will hit are evicted last, the one wanted "
                "farthest back in the queue first (0: off)"})
    segment_reuse: bool = field(default=SchedulerConfig.segment_reuse, metadata={
        "help": "segments of a prompt (chat messages; a completions prompt given as a list of {\"text\"} parts) "
                "reuse the KV of the same tokens cached alone, at any position: keys re-rotated, each segment's "
                "first --segment-recompute share recomputed (approximate: see docs/segments.md)"})
    segment_recompute: float = field(default=SchedulerConfig.segment_recompute, metadata={
        "help": "segment reuse: the share of a reused segment's tokens recomputed, its first ones (1: exact, 0: "
                "pure reuse)"})
    segment_header: str = field(default=SchedulerConfig.segment_header, metadata={
        "choices": SEGMENT_HEADERS,
        "help": "segment reuse: a segment is cached after the model's header (BOS or nothing: reused after any "
                "text) or after the prompt's first segment (first_segment: reused only after the same system "
                "prompt, more accurately)"})
    preemption_order: str = field(default=SchedulerConfig.preemption_order, metadata={
        "choices": VICTIM_ORDERS,
        "help": "preemption victim: lowest priority, then the latest arrival (latest) or the one losing the "
                "least progress (least_progress)"})
    kv_events: bool = field(default=False, metadata={
        "help": "log every block the prefix cache stores or evicts as numbered KV event batches "
                "(LLMEngine.drain_kv_events), for a KV-aware router"})
    max_pinned_fraction: float = field(default=0.5, metadata={
        "help": "cap on the fraction of the pool's blocks that pinned prefixes may hold"})
    seed: int = field(default=0, metadata={
        # --seed is the sampling seed of generate and chat
        "flag": "--engine-seed", "dest": "engine_seed", "help": "the engine's torch seed (e.g. random weights)"})
    cpu_cache_gb: float = field(default=0.0, metadata={"group": TIERS, "help": "CPU-memory tier size (0: off)"})
    disk_cache_dir: str | None = field(default=None, metadata={
        "group": TIERS, "help": "local-disk tier directory (off if not given)"})
    disk_cache_gb: float = field(default=10.0, metadata={"group": TIERS, "help": "local-disk tier size"})
    remote_cache: str | None = field(default=None, metadata={"group": TIERS, "help": "redis://host:port shared tier"})
    tier_encryption_key_file: str | None = field(default=None, metadata={
        "group": TIERS,
        "help": "file holding a 32-byte key (raw, or 64 hex digits; keep it mode 600): the disk and Redis tiers "
                "store blocks AES-256-GCM encrypted and bound to their block hash"})
    kv_transfer_gb: float = field(default=0.0, metadata={
        "group": TIERS,
        "help": "host memory for KV blocks that another engine computed and sent (the decode engines of "
                "disaggregated prefill); 0: off"})
    tier_verify: str = field(default="auto", metadata={
        "group": TIERS, "choices": TIER_VERIFY,
        "help": "where CPU-tier loads are checked: host (xxh3 on host threads before the copy), device (a digest "
                "of the copied rows on the device, computed there at store time too), auto (device on a GPU)"})
    tier_lookahead: int = field(default=1024, metadata={
        "group": TIERS,
        "help": "waiting requests whose prefix blocks the CPU tier evicts last, farthest in the queue first "
                "(0: the tier's eviction policy alone)"})
    tier_eviction_policy: str = field(default="lru", metadata={
        "group": TIERS, "choices": online_policies, "aliases": ("--tier-policy",),
        "help": "the CPU tier's eviction policy, among the blocks no waiting request will hit (the device's "
                "policy classes; kvos simulate's tier takes the same flag)"})
    write_policy: str = field(default="write_through", metadata={
        "group": TIERS, "choices": WRITE_POLICIES,
        "help": "write_through: a block goes to every tier once computed; write_back: to a tier only when the "
                "one above evicts it"})
    preemption_mode: str = field(default="recompute", metadata={
        "group": TIERS, "choices": PREEMPTION_MODES,
        "help": "recompute: a preempted request's KV is dropped and recomputed; swap: it waits in host memory"})
    swap_space_gb: float = field(default=4.0, metadata={
        "group": TIERS, "help": "host memory for swapped-out KV (--preemption-mode swap)"})
    tensor_parallel_size: int = field(default=1, metadata={
        "help": "shard each layer over this many devices (GPUs cuda:0.., NCCL; on the CPU, processes with gloo): "
                "attention heads, MLP columns and the vocabulary split, KV heads too"})
    encoder_cache_mb: float = field(default=256.0, metadata={
        "group": IMAGES, "help": "most of the KV pool's memory that image encodings may hold (kept by content, so a "
                                 "later request with the same image skips the encoder even when its KV was "
                                 "evicted; encodings and KV trade pages); 0: none kept"})
    limit_images_per_prompt: int = field(default=8, metadata={
        "group": IMAGES, "help": "most images one prompt may hold"})
    max_image_pixels: int = field(default=40_000_000, metadata={
        "group": IMAGES, "help": "most pixels (width x height) of one decoded image"})
    allow_remote_images: bool = field(default=False, metadata={
        "group": IMAGES, "help": "fetch http(s) image URLs (off: only data: URLs, since a server reaches no "
                                 "network by default)"})
    random_weights: bool = field(default=False, metadata={
        "help": "draw weights at random from the model's config (benchmarks without real weights)"})
    tokenizer: str | None = field(default=None, metadata={
        "help": "use this model's tokenizer (a GGUF file, HF folder or bundled model name) instead of the "
                "model's own; its vocabulary must fit the model's (e.g. a random-weight config with a real "
                "tokenizer)"})
    skip_tokenizer_init: bool = field(default=False, metadata={
        "help": "no tokenizer: prompts are token ids, outputs are token ids with empty text (no detokenizing, "
                "no stop strings); a model without tokenizer files needs it to be served"})
    gpu_memory_utilization: float = field(default=0.9, metadata={
        "help": "fraction of the GPU's memory the engine may use (weights, activations and KV pool)"})
    enforce_eager: bool = field(default=False, metadata={"help": "no CUDA graphs"})
    mixed_graph_tokens: int = field(default=1024, metadata={
        "help": "on a GPU, steps with prefill rows of up to this many tokens replay CUDA graphs of everything "
                "between the attention kernels (piecewise graphs; Llama-family models on one rank); 0: only "
                "decode steps run in graphs"})
    block_weights: bool = field(default=True, metadata={
        "flag": "--no-block-weights", "negate": True,
        "help": "on the CPU, decode-size batches multiply a GGUF's Q4_1/Q8_0 layers as stored, through C kernels "
                "(AVX2; the same float32 weights, a quarter to a seventh of the bytes); off: float32 copies only"})
    async_scheduling: bool | None = field(default=None, metadata={
        "help": "schedule and queue step N+1 while step N runs (default: on for a CUDA device)"})
    generation_config: str = field(default="auto", metadata={
        "choices": GENERATION_CONFIGS,
        "help": "request sampling defaults: auto takes the model's recommended temperature/top-p/top-k/min-p/"
                "repetition penalty (a folder's generation_config.json, or kvos's table for GGUF files); kvos "
                "leaves them at temperature 1, top-p 1"})
    override_generation_config: dict | str | None = field(default=None, metadata={
        "type": str, "metavar": "JSON",
        "help": "request sampling defaults that win over the model's, e.g. '{\"temperature\": 0.7}'"})
    speculative_config: SpeculativeConfig | dict | str | None = field(default=None, metadata={
        "type": str, "metavar": "JSON",
        "help": "speculative decoding, vLLM's shape: '{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
                "\"prompt_lookup_min\": 2, \"prompt_lookup_max\": 4}', '{\"method\": \"draft_model\", \"model\": "
                "PATH, ...}' or '{\"method\": \"self_draft\", \"num_draft_layers\": N, ...}' (plus "
                "disable_by_batch_size: no drafts above that many sequences); speculative steps run synchronously"})

    def __post_init__(self) -> None:
        if self.kv_cache_memory_bytes is not None and (not isinstance(self.kv_cache_memory_bytes, int)
                                                       or self.kv_cache_memory_bytes < 1):
            raise ValueError(f"kv_cache_memory_bytes must be a positive integer, got {self.kv_cache_memory_bytes!r}")
        if not isinstance(self.mixed_graph_tokens, int) or self.mixed_graph_tokens < 0:
            raise ValueError(f"mixed_graph_tokens must be a non-negative integer, got {self.mixed_graph_tokens!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {self.block_size!r}")
        self.scheduler_config()  # the scheduler's fields are checked there
        if self.num_blocks is not None and (not isinstance(self.num_blocks, int) or self.num_blocks < 2):
            raise ValueError(f"num_blocks must be an integer >= 2, got {self.num_blocks!r}")
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout must be 'unified', 'equal_pages' or 'homogeneous', got {self.kv_layout!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        for name, allowed in (("eviction_policy", tuple(EVICTION_POLICIES)), ("tier_verify", TIER_VERIFY)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.tier_eviction_policy not in online_policies():
            raise ValueError(f"tier_eviction_policy must be one of {list(online_policies())}, "
                             f"got {self.tier_eviction_policy!r}")
        if not isinstance(self.tier_lookahead, int) or self.tier_lookahead < 0:
            raise ValueError(f"tier_lookahead must be a non-negative integer, got {self.tier_lookahead!r}")
        if not 0 <= self.max_pinned_fraction <= 1:
            raise ValueError(f"max_pinned_fraction must be in [0, 1], got {self.max_pinned_fraction!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ValueError(f"max_model_len must be an integer >= 2, got {self.max_model_len!r}")
        if self.segment_reuse and self.kv_cache_dtype != "auto":
            raise ValueError(f"segment_reuse needs kv_cache_dtype 'auto' (keys are re-rotated in the model's dtype), "
                             f"got {self.kv_cache_dtype!r}")
        if self.segment_reuse and not self.enable_prefix_caching:
            raise ValueError("segment_reuse needs prefix caching (segments are cached in the prefix cache)")
        if not isinstance(self.encoder_cache_mb, (int, float)) or self.encoder_cache_mb < 0:
            raise ValueError(f"encoder_cache_mb must be a non-negative number, got {self.encoder_cache_mb!r}")
        for name in ("limit_images_per_prompt", "max_image_pixels"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        self._check_tensor_parallel()
        if self.generation_config not in GENERATION_CONFIGS:
            raise ValueError(f"generation_config must be one of {GENERATION_CONFIGS}, got {self.generation_config!r}")
        if self.override_generation_config is not None:
            self.override_generation_config = parse_override(self.override_generation_config)
        if self.tier_encryption_key_file is not None:
            from kvos.cache.tiers.codec import load_key_file

            load_key_file(self.tier_encryption_key_file)  # raises ValueError naming tier_encryption_key_file

    def _check_tensor_parallel(self) -> None:
        """ValueError naming the setting that cannot run with ``tensor_parallel_size`` > 1:
        speculative decoding, and ``tier_verify="device"`` (the CPU tier's digest frames would be
        per rank; ``auto`` verifies on the host then). Tiers and swap run: each rank reads and
        writes its part of a block (``ParallelRunner.read_blocks``)."""
        tp = self.tensor_parallel_size
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {tp!r}")
        if tp == 1:
            return
        if self.speculative_config is not None:
            raise ValueError(f"speculative_config: not supported with tensor_parallel_size {tp} yet (speculative "
                             f"decoding runs with one rank)")
        if self.tier_verify == "device":
            raise ValueError(f"tier_verify: 'device' is not supported with tensor_parallel_size {tp} (the CPU "
                             f"tier's digests would be per rank); 'auto' verifies on the host")

    def scheduler_config(self) -> SchedulerConfig:
        """The scheduler's settings: this config's fields of the same names."""
        return SchedulerConfig(**{f.name: getattr(self, f.name) for f in fields(SchedulerConfig)})
