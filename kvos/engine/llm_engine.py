"""The engine loop: requests in, one scheduled step at a time, outputs out."""
from __future__ import annotations

import itertools
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvos.cache.block import BlockHash
from kvos.cache.eviction import online_policies
from kvos.cache.kv_manager import KVCacheManager
from kvos.cache.layout import build_layout, with_draft_group
from kvos.cache.pins import Pin, PinInfo, PinnedPrefixes
from kvos.cache.tiers import TierHierarchy
from kvos.config import EngineConfig
from kvos.connector.block_adoption import BlockAdopter
from kvos.connector.offload import OffloadManager, build_hierarchy
from kvos.connector.swap import HostSwapSpace
from kvos.core.kv_events import KVEventBatch, KVSnapshot
from kvos.core.media import MediaItem
from kvos.core.outputs import CompletionOutput, Logprob, RequestOutput
from kvos.core.request import Request, RequestStatus
from kvos.core.sampling_params import SamplingParams
from kvos.engine.detokenizer import IncrementalDetokenizer
from kvos.engine.gc_tuning import relax_gc_thresholds
from kvos.engine.media import (
    ImagePreparer,
    MediaLimits,
    PreparedImage,
    expand_image_text,
    media_items,
)
from kvos.engine.state_layout import refuse_with_state, state_group
from kvos.models.fingerprint import model_fingerprint
from kvos.models.generation_defaults import model_sampling_defaults
from kvos.models.loader import (
    load_model,
    load_tokenizer,
    load_tokenizer_for_config,
    resolve_config_path,
    resolve_model_path,
)
from kvos.scheduler.connector import KVConnectorScheduler
from kvos.scheduler.describe import describe_step, plan_encodings
from kvos.scheduler.scheduler import Scheduler, SchedulerOutput
from kvos.spec.backoff import DraftBackoff
from kvos.spec.config import SpeculativeConfig
from kvos.spec.ngram import NgramProposer
from kvos.spec.stats import SpecStats
from kvos.structured.grammars import GrammarCompiler
from kvos.structured.matchers import SequenceMatchers
from kvos.worker.device import resolve_device
from kvos.worker.draft_model import DraftModel
from kvos.worker.parallel_runner import ParallelRunner
from kvos.worker.runner import LaunchedStep, ModelRunner, parse_dtype

PromptType = str | list[int] | dict

log = logging.getLogger("kvos.engine")


@dataclass
class _PendingPin:
    pin_id: str
    token_ids: list[int]
    cache_salt: str | None
    ttl_s: float | None
    on_done: Callable[[Pin | Exception], None] | None


@dataclass
class _UserRequest:
    """The ``n`` sequences of one user request and their text."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    seqs: dict[int, Request] = field(default_factory=dict)
    detoks: dict[int, IncrementalDetokenizer] = field(default_factory=dict)
    logprobs: dict[int, list[dict[int, Logprob]]] = field(default_factory=dict)
    cum_logprob: dict[int, float] = field(default_factory=dict)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    first_token_time: float | None = None

    def finished(self) -> bool:
        parent = self.seqs[0]
        if self.params.n == 1:
            return parent.status.finished
        if parent.is_finished and not parent.forked:
            return True
        return len(self.seqs) == self.params.n and all(s.is_finished for s in self.seqs.values())


def _error_reason(error: Exception) -> str:
    """What a failed request's ``stop_reason`` says (bounded: exception texts can be long)."""
    return f"engine error: {type(error).__name__}: {error}"[:500]


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    """A text prompt's token ids (special tokens as the tokenizer adds them); ``ValueError``
    naming ``prompt`` if it is empty or cannot be encoded."""
    if not prompt:
        raise ValueError("prompt must be a non-empty string")
    try:
        ids = list(tokenizer(prompt).input_ids)
    except Exception as e:  # e.g. lone surrogates the tokenizer cannot encode
        raise ValueError(f"prompt cannot be tokenized ({type(e).__name__}: {e})") from e
    if not ids:
        raise ValueError(f"prompt {prompt[:20]!r} encodes to no tokens")
    return ids


def encode_segments(tokenizer, segments, vocab_size: int) -> tuple[str | None, list[int], tuple[tuple[int, int], ...]]:
    """A prompt given as segments (strings or token id lists): its text (None unless every
    segment is a string), its ids (the first text segment with the tokenizer's special tokens,
    later ones without) and each segment's span of them. ``ValueError`` naming the segment."""
    if not isinstance(segments, list) or not segments:
        raise ValueError("segments must be a non-empty list of strings or token id lists")
    ids: list[int] = []
    spans = []
    for i, seg in enumerate(segments):
        if isinstance(seg, str):
            if tokenizer is None:
                raise ValueError(f"segments[{i}]: this engine has no tokenizer; pass token ids")
            if not seg:
                raise ValueError(f"segments[{i}] must be a non-empty string")
            piece = encode_prompt(tokenizer, seg) if not ids else list(tokenizer(seg, add_special_tokens=False).input_ids)
        elif isinstance(seg, list) and seg and all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in seg):
            piece = list(seg)
        elif isinstance(seg, list):
            raise ValueError(f"segments[{i}] must be a non-empty list of integers in [0, {vocab_size})")
        else:
            raise ValueError(f"segments[{i}] must be a string or a list of token ids, got {type(seg).__name__}")
        spans.append((len(ids), len(ids) + len(piece)))
        ids += piece
    text = "".join(segments) if all(isinstance(x, str) for x in segments) else None
    return text, ids, tuple(spans)


def truncate_prompt(ids: list[int], spans: tuple[tuple[int, int], ...], k: int
                    ) -> tuple[list[int], tuple[tuple[int, int], ...]]:
    """``truncate_prompt_tokens``: the last ``k`` of a prompt's ids (vLLM's left truncation), and
    the segment spans wholly inside them, moved with them (a cut segment is no segment)."""
    cut = max(0, len(ids) - k)
    return ids[cut:], tuple((a - cut, b - cut) for a, b in spans if a >= cut)


class LLMEngine:
    """Owns the tokenizer, the KV memory system, the scheduler and the model runner.

    Not thread-safe: one caller drives ``add_request``/``abort_request``/``step``.
    A bad request is rejected in ``add_request`` with a ``ValueError`` naming the field and
    leaves the engine and other requests untouched.
    """

    offload: KVConnectorScheduler | None
    """The KV connector's scheduler side (``kvos.scheduler.connector``): blocks to and from the
    tiers below the device, and blocks another engine prefilled (``receive``); None without tiers."""
    tiers: TierHierarchy | None
    """The tiers below the device that ``offload`` serves (None without)."""

    def __init__(self, config: EngineConfig) -> None:
        if config.eviction_policy not in online_policies():
            raise ValueError(f"eviction_policy {config.eviction_policy!r} reads the future (the simulator's "
                             f"oracle); an engine takes one of {online_policies()}")
        self.config = config
        t0 = time.perf_counter()
        torch.manual_seed(config.seed)
        if config.random_weights:
            path = resolve_config_path(config.model)
            self.tokenizer = None if config.skip_tokenizer_init else load_tokenizer_for_config(path)
        else:
            path = resolve_model_path(config.model)
            self.tokenizer = None if config.skip_tokenizer_init else load_tokenizer(path)
        if config.tokenizer is not None and not config.skip_tokenizer_init:
            self.tokenizer = load_tokenizer(resolve_model_path(config.tokenizer))
        self.model_path = path
        device = resolve_device(config.device)
        dtype = parse_dtype(config.dtype or ("bfloat16" if device.startswith("cuda") else "float32"))
        if config.tensor_parallel_size > 1:
            self.runner = ParallelRunner(config.tensor_parallel_size, path, dtype, torch.device(device),
                                         random_weights=config.random_weights)
        else:
            self.runner = ModelRunner(path, dtype, torch.device(device), random_weights=config.random_weights,
                                      block_weights=config.block_weights)
        mc = self.model_config = self.runner.cfg
        self.media: ImagePreparer | None = None
        """A vision-language model's image preparation (decode, limits, the checkpoint's processor)."""
        if mc.vision is not None:
            self.media = ImagePreparer(mc.vision, path if path.is_dir() else None, MediaLimits(
                max_images=config.limit_images_per_prompt, max_pixels=config.max_image_pixels,
                allow_remote=config.allow_remote_images, allow_files=True))
        if self.tokenizer is not None and len(self.tokenizer) > mc.vocab_size:
            raise ValueError(f"tokenizer: {len(self.tokenizer)} tokens do not fit the model's vocabulary of "
                             f"{mc.vocab_size}")
        spec = config.speculative_config
        draft_path = None
        if spec is not None and spec.uses_model:
            draft_path = self._set_draft(spec, dtype)
        t_weights = time.perf_counter()
        self.max_model_len = min(config.max_model_len or mc.max_position_embeddings,
                                 mc.max_position_embeddings)
        model_dtype = str(dtype).removeprefix("torch.")
        self.kv_cache_dtype = model_dtype if config.kv_cache_dtype == "auto" else config.kv_cache_dtype
        self.layout = build_layout(mc.layer_windows(), config.block_size, self.runner.kv_heads, mc.head_dim,
                                   self.kv_cache_dtype, config.kv_layout, *state_group(mc, config))
        draft = self.runner.draft
        if draft is not None and draft.owns_kv:
            dc = draft.cfg
            self.layout = with_draft_group(self.layout, dc.num_layers, dc.num_kv_heads, dc.head_dim,
                                           self.kv_cache_dtype)
        num_blocks = config.num_blocks or self._num_blocks_for_budget()
        t_profile = time.perf_counter()
        if num_blocks < 2:
            raise ValueError(f"the KV budget holds fewer than two pages of {self.layout.large_page_bytes} bytes "
                             f"(kv_cache_memory_bytes={config.kv_cache_memory_bytes}, "
                             f"gpu_memory_utilization={config.gpu_memory_utilization})")
        if mc.mamba is not None:
            refuse_with_state(config, self.kv_cache_dtype, model_dtype)
        if len(self.layout.groups) > 1 and config.kv_transfer_gb:
            raise ValueError("kv_transfer_gb: disaggregated prefill sends one cache group's block rows (the "
                             f"sender's read_blocks), and this model's layout {config.kv_layout!r} has "
                             f"{len(self.layout.groups)} groups; use kv_layout='homogeneous'")
        model_id = model_fingerprint(path, self.kv_cache_dtype, config.random_weights)
        if draft_path is not None:  # a tier shared with engines of other drafts must not mix their groups
            model_id += "|draft=" + model_fingerprint(draft_path, self.kv_cache_dtype, config.random_weights)
        self.kv = KVCacheManager(self.layout, num_blocks, model_id=model_id,
                                 enable_caching=config.enable_prefix_caching, policy=config.eviction_policy)
        if self.media is not None and config.encoder_cache_mb > 0:  # encodings in the pool's pages
            page = self.layout.large_page_bytes
            slot = min(g.spec.page_bytes for g in self.layout.groups)
            self.kv.attach_encoder(slot, max(1, int(config.encoder_cache_mb * (1 << 20)) // page))
            self.runner.encoder_slot_bytes = slot
        self._encoding_bytes = (mc.vision.tokens_per_image * mc.hidden_size * dtype.itemsize
                                if mc.vision is not None else 0)
        """Bytes of one image's encoding (the projector's output in the model's dtype)."""
        self.kv_events = (self.kv.enable_events(f"{socket.gethostname()}:{os.getpid()}") if config.kv_events
                          else None)
        self.runner.allocate_kv_cache(self.layout, num_blocks)
        t_alloc = time.perf_counter()
        # no decode graphs without attention layers (pure Mamba2) nor with experts (their routing syncs the host)
        if self.runner.device.type == "cuda" and not config.enforce_eager and mc.attention_layers and not mc.num_experts:
            rows = config.max_num_seqs  # a verify step is a decode batch of k + 1 rows per sequence
            spec = config.speculative_config
            if spec is not None:
                rows = max(rows, min(rows, spec.disable_by_batch_size) * (spec.num_speculative_tokens + 1))
            self.runner.capture_cuda_graphs(rows, self.max_model_len,
                                            mixed_tokens=min(config.mixed_graph_tokens, config.max_num_batched_tokens))
        t_graphs = time.perf_counter()
        self.startup_s = {"weights": t_weights - t0, "kv_profile": t_profile - t_weights,
                          "kv_allocate": t_alloc - t_profile, "cuda_graphs": t_graphs - t_alloc}
        """Seconds each start-up phase took (tokenizer and weights, KV budget profiling, pool
        allocation, CUDA graph capture)."""
        log.info("engine start-up: %s (%d KV blocks)",
                 ", ".join(f"{k} {v:.1f} s" for k, v in self.startup_s.items()), num_blocks)
        self.scheduler = Scheduler(config.scheduler_config(), self.kv)
        if self.scheduler.segments is not None and self.tokenizer is not None:
            # a segment's source chain starts like every prompt: with the tokenizer's own prefix (BOS)
            self.scheduler.segments.header = list(self.tokenizer("").input_ids)
        relax_gc_thresholds()
        self.steps, self.step_seconds, self.batched_tokens = 0, 0.0, 0
        self._prefill_token_s: float | None = None
        self.segment_saved_seconds = 0.0
        """Steps scheduled, wall seconds spent inside ``step``, tokens those steps computed."""
        self.async_scheduling = (config.async_scheduling if config.async_scheduling is not None
                                 else self.runner.device.type == "cuda")
        self._in_flight: tuple[SchedulerOutput, LaunchedStep] | None = None
        self._open_steps: list[SchedulerOutput] = []  # scheduled, not yet finished: blamed if a step raises
        self._produced: list[RequestOutput] = []  # outputs of steps finished inside the current ``step`` call
        self.failed_steps = 0
        """Steps that raised; each failed the requests it held (``FINISHED_ERROR``)."""
        eos = set(mc.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        tok_eos = self.tokenizer.eos_token_id if self.tokenizer is not None else None
        self.matchers = SequenceMatchers(GrammarCompiler(
            self.tokenizer, tok_eos if tok_eos is not None else min(eos, default=0), mc.vocab_size))
        """Grammar state of the sequences with ``structured_outputs``; see ``kvos.structured``."""
        self._constrained: set[str] = set()  # user requests with structured outputs, not finished
        tok = self.tokenizer
        self._token_text: Callable[[int], str] | None = None if tok is None else lambda t: tok.decode([t])
        """Decodes a logprob's ``decoded_token`` when first read (None without a tokenizer, as vLLM)."""
        hierarchy = build_hierarchy(config.cpu_cache_gb, config.disk_cache_dir, config.disk_cache_gb,
                                    config.remote_cache, config.write_policy,
                                    pinned=self.runner.device.type == "cuda",
                                    encryption_key_file=config.tier_encryption_key_file,
                                    transfer_gb=config.kv_transfer_gb,
                                    eviction_policy=config.tier_eviction_policy,
                                    device_verify=config.tier_verify == "device" or (
                                        config.tier_verify == "auto" and self.runner.device.type == "cuda"
                                        and config.tensor_parallel_size == 1))
        self.offload = (OffloadManager(hierarchy, self.runner, self.kv, self.scheduler, config.tier_lookahead)
                        if hierarchy else None)
        self.tiers = hierarchy
        self._adopter = BlockAdopter(self.kv, self.runner)
        if config.preemption_mode == "swap":
            self.scheduler.swapper = HostSwapSpace(self.runner, int(config.swap_space_gb * (1 << 30)), self.kv)
        self._user_requests: dict[str, _UserRequest] = {}
        self._user_request_of: dict[str, _UserRequest] = {}
        self._ids = itertools.count()
        self.pins = PinnedPrefixes(self.kv, config.max_pinned_fraction) if config.enable_prefix_caching else None
        self._pending_pins: dict[str, _PendingPin] = {}  # compute request id -> pin to take
        self.default_sampling: dict[str, float] = {
            **({} if config.generation_config == "kvos" else model_sampling_defaults(path)),
            **(config.override_generation_config or {})}
        """Sampling values for the fields a server request leaves unset (``generation_config``)."""
        self.speculative = config.speculative_config
        """How the engine speculates (None: it does not); see ``kvos.spec``."""
        self.proposer = (NgramProposer(self.speculative.num_speculative_tokens, self.speculative.prompt_lookup_min,
                                       self.speculative.prompt_lookup_max)
                         if self.speculative is not None and not self.speculative.uses_model else None)
        """The n-gram proposer (None: no speculation, or drafts from the runner's draft model)."""
        self.spec_stats = SpecStats()
        self._draft_backoff = DraftBackoff()  # per sequence: drafts that were all rejected
        self._probe_backoff = DraftBackoff(16)  # the engine: with async scheduling, probes that found no draft
        self.schedule_hook = None
        """Called with each step's SchedulerOutput before it runs (tests compare the simulator)."""

    def _set_draft(self, spec: SpeculativeConfig, dtype: torch.dtype) -> Path | None:
        """Give the runner its draft model (``draft_model``: loaded from ``spec.model``, random
        weights too when the target's are; ``self_draft``: the target's first layers). Returns the
        draft's own path, if any. ``ValueError`` naming the key when the pair cannot work."""
        mc = self.runner.cfg
        if spec.method == "self_draft":
            if spec.num_draft_layers >= mc.num_layers:
                raise ValueError(f"speculative_config.num_draft_layers ({spec.num_draft_layers}) must be fewer "
                                 f"than the model's {mc.num_layers} layers")
            self.runner.set_draft(DraftModel(self.runner.model, mc, spec.num_draft_layers, owns_kv=False))
            return None
        try:
            path = (resolve_config_path(spec.model) if self.config.random_weights
                    else resolve_model_path(spec.model))
        except ValueError as e:
            raise ValueError(f"speculative_config.{e}") from None
        dcfg, model = load_model(path, dtype, self.runner.device, self.config.random_weights,
                                 self.config.block_weights)
        if dcfg.vocab_size != mc.vocab_size:
            raise ValueError(f"speculative_config.model: the draft's vocabulary has {dcfg.vocab_size} tokens, "
                             f"the target's {mc.vocab_size}; a draft must share the target's tokenizer")
        if any(w is not None for w in dcfg.layer_windows()):
            raise ValueError("speculative_config.model: a draft with sliding-window layers is not supported")
        self.runner.set_draft(DraftModel(model, dcfg, None, owns_kv=True))
        return path

    def _num_blocks_for_budget(self) -> int:
        budget = self.config.kv_cache_memory_bytes
        if budget is None and self.runner.device.type == "cuda":
            budget = self.runner.profile_kv_budget(self.config.gpu_memory_utilization,
                                                   self.config.max_num_batched_tokens)
            if any(g.spec.quantized for g in self.layout.groups):
                # the room long prefill chunks take to dequantize their context (the profile ran
                # on a 16-bit scratch cache, which never does)
                from kvos.kernels.prefill_attention import DEQUANTIZE_MAX_BYTES
                budget = max(0, budget - DEQUANTIZE_MAX_BYTES)
        return self.layout.num_pages_for_memory(budget or 2 << 30)

    # -- requests ------------------------------------------------------------------------
    def tokenize_segments(self, segments) -> tuple[str | None, list[int], tuple[tuple[int, int], ...]]:
        """``encode_segments`` with this engine's tokenizer and vocabulary."""
        return encode_segments(self.tokenizer, segments, self.model_config.vocab_size)

    def tokenize_request(self, prompt: PromptType) -> tuple[str | None, list[int], tuple[tuple[int, int], ...]]:
        """Any prompt form's text (or None), token ids and segment spans: ``{"segments": [...]}``
        (``tokenize_segments``), or a dict with ``prompt_token_ids`` and ``segment_spans`` (spans
        already made, e.g. by ``tokenize_segments`` or a chat's messages), or what
        ``tokenize_prompt`` takes (no segments)."""
        if isinstance(prompt, dict) and "segments" in prompt:
            return self.tokenize_segments(prompt["segments"])
        if (isinstance(prompt, dict) and prompt.get("multi_modal_data") is not None
                and "prompt_token_ids" not in prompt and isinstance(prompt.get("prompt"), str)):
            if self.media is None:
                raise ValueError("multi_modal_data: this model takes no images")
            if self.tokenizer is None:
                raise ValueError("prompt: this engine has no tokenizer; pass prompt_token_ids with the image tokens")
            images = self.prompt_images(prompt["multi_modal_data"])  # (prepared once: add_request's are)
            text = expand_image_text(prompt["prompt"], self.tokenizer, self.media.vision, images)
            return text, encode_prompt(self.tokenizer, text), ()
        text, ids = self.tokenize_prompt(prompt)
        spans = prompt.get("segment_spans") if isinstance(prompt, dict) else None
        if not spans:
            return text, ids, ()
        try:
            spans = tuple((int(a), int(b)) for a, b in spans)
        except (TypeError, ValueError):
            raise ValueError("segment_spans must be a list of [start, end) pairs") from None
        end = 0
        for a, b in spans:
            if not end <= a < b <= len(ids):
                raise ValueError(f"segment_spans must be ordered, disjoint and within the prompt's {len(ids)} "
                                 f"tokens, got {list(spans)!r}")
            end = b
        return text, ids, spans

    def prompt_images(self, data, names: list[str] | None = None) -> list[PreparedImage]:
        """``multi_modal_data``'s images decoded and preprocessed (``ImagePreparer``); ValueError
        naming ``multi_modal_data.image[i]`` (or ``names[i]``) for a bad one, or past the
        per-prompt limit."""
        if self.media is None:
            raise ValueError("multi_modal_data: this model takes no images")
        return self.media.prepare_all(data, names)

    def prompt_media(self, prompt: PromptType, ids: list[int], cache_salt: str | None) -> tuple[MediaItem, ...]:
        """The prompt's images paired with its image-token runs (none without ``multi_modal_data``,
        where the prompt may hold no image token)."""
        data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        if data is None:
            if self.media is not None and self.media.vision.image_token_id in ids:
                raise ValueError("prompt_token_ids: the prompt holds image tokens but no multi_modal_data")
            return ()
        items = media_items(ids, self.prompt_images(data), self.media.vision, cache_salt)
        longest = self.config.max_num_batched_tokens
        if items and items[0].length > longest:
            raise ValueError(f"multi_modal_data: an image takes {items[0].length} tokens, more than "
                             f"max_num_batched_tokens ({longest}), and is computed in one step")
        return items

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: this engine has no tokenizer (random weights without tokenizer files, or "
                                 "skip_tokenizer_init); pass prompt_token_ids")
            return prompt, encode_prompt(self.tokenizer, prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._check_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self.tokenize_prompt(prompt["prompt"])
            raise ValueError("prompt dict needs 'prompt', 'prompt_token_ids' or 'segments'")
        if isinstance(prompt, list):
            return None, self._check_ids(prompt)
        raise ValueError(f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def _check_ids(self, ids) -> list[int]:
        vocab = self.model_config.vocab_size
        if not isinstance(ids, list) or not ids:
            raise ValueError("prompt_token_ids must be a non-empty list of integers")
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt_token_ids must be integers in [0, {vocab})")
        return list(ids)

    def add_request(self, prompt: PromptType, params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0,
                    cache_salt: str | None = None) -> str:
        params = params or SamplingParams()
        params.validate(self.model_config.vocab_size)
        if self.tokenizer is None and params.stop_strings:
            raise ValueError("stop: stop strings need a tokenizer, and this engine has none; use stop_token_ids")
        if params.bad_words:
            if self.tokenizer is None:
                raise ValueError("bad_words: bad words need a tokenizer, and this engine has none; "
                                 "use allowed_token_ids or logit_bias")
            params.update_from_tokenizer(self.tokenizer, self.model_config.vocab_size)
        if not isinstance(priority, int):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt must be a string, got {type(cache_salt).__name__}")
        if params.n > self.config.max_num_seqs:
            raise ValueError(f"n is {params.n}; max_num_seqs is {self.config.max_num_seqs}, so its sequences "
                             f"could never run together")
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._user_requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if isinstance(prompt, dict) and prompt.get("multi_modal_data") is not None:  # decoded and prepared once
            prompt = {**prompt, "multi_modal_data": {"image": self.prompt_images(prompt["multi_modal_data"])}}
        text, ids, segments = self.tokenize_request(prompt)
        k = params.truncate_prompt_tokens
        if k is not None and len(ids) > k:
            if isinstance(prompt, dict) and prompt.get("multi_modal_data") is not None:
                raise ValueError("truncate_prompt_tokens: a prompt with images cannot be cut")
            ids, segments = truncate_prompt(ids, segments, k)
            text = self.tokenizer.decode(ids) if text is not None and self.tokenizer is not None else None
        media = self.prompt_media(prompt, ids, cache_salt)
        if media and segments:
            raise ValueError("segment_spans: segment reuse with images is not supported")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt is {len(ids)} tokens; max_model_len is {self.max_model_len}, "
                             f"which leaves no room for output")
        usable = self.kv.capacity_tokens(self.config.max_num_batched_tokens)
        if len(ids) + 1 > usable:
            raise ValueError(f"prompt is {len(ids)} tokens; the KV pool holds only {usable} "
                             f"(raise kv_cache_memory_bytes)")
        if params.structured_outputs is not None:  # compiled (and cached) now: a bad schema is a ValueError
            self.matchers.compiler.matcher(params.structured_outputs)
        req = Request(request_id, ids, params, self.eos_token_ids, priority=priority,
                      cache_salt=cache_salt, max_model_len=self.max_model_len, segments=segments, media=media)
        ureq = _UserRequest(request_id, text, ids, params, time.monotonic())
        if params.prompt_logprobs is not None:
            ureq.prompt_logprobs = [None] * len(ids)
        ureq.seqs[0] = req
        self._user_requests[request_id] = ureq
        self._user_request_of[request_id] = ureq
        self.scheduler.add_request(req)
        if params.structured_outputs is not None:
            self._constrained.add(request_id)
        return request_id

    def abort_request(self, request_id: str) -> None:
        """Abort every sequence of a request; its blocks are freed at once."""
        ureq = self._user_requests.pop(request_id, None)
        if ureq is None:
            return
        self._finish_sequences(request_id, RequestStatus.FINISHED_ABORTED)
        self._forget(ureq)

    def _finish_sequences(self, parent_id: str, status: RequestStatus) -> list[Request]:
        """Finish every sequence of ``parent_id`` still in the scheduler (blocks freed at once)."""
        seqs = [seq for seq in self.scheduler.requests.values() if seq.parent_id == parent_id]
        for seq in seqs:
            self.scheduler.finish_request(seq.request_id, status)
        return seqs

    def _forget(self, ureq: _UserRequest) -> None:
        """Drop the per-sequence state of a request that finished or was aborted."""
        for seq in ureq.seqs.values():
            self._user_request_of.pop(seq.request_id, None)
            if self.speculative is not None:
                self._drop_drafter_state(seq.request_id)
            if ureq.request_id in self._constrained:
                self.matchers.drop(seq.request_id)
        self._constrained.discard(ureq.request_id)

    def request_ids(self) -> list[str]:
        """Ids of the requests not finished yet."""
        return list(self._user_requests)

    def shutdown(self) -> None:
        """Release what outlives the engine object: a tensor-parallel engine's worker processes
        and process group (another may be made in this process afterwards)."""
        stop = getattr(self.runner, "shutdown", None)
        if stop is not None:
            stop()

    def has_unfinished_requests(self) -> bool:
        """Requests not finished yet, or the engine's own work for them (segment fills)."""
        return bool(self._user_requests) or self.scheduler.has_unfinished()

    # -- pinned prefixes -----------------------------------------------------------------
    def pin_prefix(self, prompt: PromptType, ttl_s: float | None = None, cache_salt: str | None = None,
                   pin_id: str | None = None, on_done: Callable[[Pin | Exception], None] | None = None) -> str:
        """Compute ``prompt``'s KV (a one-token request, hitting what is cached) and pin its full
        blocks for ``cache_salt``'s tenant until ``unpin_prefix`` or ``ttl_s`` seconds: no
        eviction policy takes them meanwhile. The pin is taken when that request finishes;
        ``on_done`` then gets the ``Pin`` or the error (e.g. over ``max_pinned_fraction``)."""
        if self.pins is None:
            raise ValueError("pinned prefixes need prefix caching (enable_prefix_caching)")
        if ttl_s is not None and (not isinstance(ttl_s, (int, float)) or ttl_s <= 0):
            raise ValueError(f"ttl_s must be a positive number of seconds, got {ttl_s!r}")
        _, ids = self.tokenize_prompt(prompt)
        if len(ids) < self.kv.block_size:
            raise ValueError(f"prompt is {len(ids)} tokens; a pin holds whole blocks of {self.kv.block_size}")
        pin_id = pin_id or f"pin-{uuid.uuid4().hex}"
        rid = self.add_request({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=1),
                               request_id=f"{pin_id}#compute", cache_salt=cache_salt)
        self._pending_pins[rid] = _PendingPin(pin_id, ids, cache_salt, ttl_s, on_done)
        return pin_id

    def unpin_prefix(self, pin_id: str) -> bool:
        """Release a pin (its blocks become evictable again); False if there is none."""
        return self.pins is not None and self.pins.unpin(pin_id)

    def pin_infos(self, pin_ids: Collection[str]) -> list[PinInfo]:
        """The live pins among ``pin_ids``, as a client sees them."""
        if self.pins is None:
            return []
        now = time.monotonic()
        return [PinInfo.of(p, now) for p in self.pins.pins.values() if p.pin_id in pin_ids]

    def _take_pins(self, finished_ids: list[str]) -> None:
        for rid in finished_ids:
            pending = self._pending_pins.pop(rid, None)
            if pending is None:
                continue
            try:
                result: Pin | Exception = self.pins.pin(pending.pin_id, pending.token_ids, pending.cache_salt,
                                                        time.monotonic(), pending.ttl_s)  # type: ignore[union-attr]
            except ValueError as e:
                result = e
            if pending.on_done is not None:
                pending.on_done(result)

    # -- the loop ------------------------------------------------------------------------
    def step(self, final_only: bool = False) -> list[RequestOutput]:
        """Schedule and launch one step, then finish one: the same step, or with async
        scheduling the step launched by the previous call (so host work overlaps the device).
        Returns outputs of requests that changed; with ``final_only``, only of those that
        finished (vLLM's ``FINAL_ONLY``: no output is built for a request still running)."""
        t0, tokens, reused = time.perf_counter(), self.batched_tokens, self.kv.counters.segment_reused_tokens
        self._produced = []
        try:
            return self._step(final_only)
        except Exception as e:
            return self._fail_open_steps(e)
        finally:
            dt = time.perf_counter() - t0
            self.step_seconds += dt
            self._estimate_segment_savings(dt, self.batched_tokens - tokens,
                                           self.kv.counters.segment_reused_tokens - reused)

    def _estimate_segment_savings(self, seconds: float, tokens: int, reused: int) -> None:
        """Segment reuse's time saved, estimated: tokens reused times the recent seconds per
        token of steps that computed at least 64 tokens (prefill-heavy steps)."""
        if tokens >= 64:
            rate = seconds / tokens
            self._prefill_token_s = rate if self._prefill_token_s is None else 0.8 * self._prefill_token_s + 0.2 * rate
        if reused and self._prefill_token_s is not None:
            self.segment_saved_seconds += reused * self._prefill_token_s

    def _speculates_now(self) -> bool:
        """Load awareness: speculate only while the step's batch (running sequences plus those
        that may join) is at most ``disable_by_batch_size``."""
        assert self.speculative is not None
        batch = min(self.config.max_num_seqs, len(self.scheduler.running) + self.scheduler.num_waiting())
        if batch <= self.speculative.disable_by_batch_size:
            return True
        self.spec_stats.skipped_for_load += 1
        return False

    def _drop_drafter_state(self, request_id: str) -> None:
        if self.proposer is not None:
            self.proposer.drop(request_id)
        self._draft_backoff.drop(request_id)

    def _propose(self) -> bool:
        """Draft tokens for every running sequence that decodes one known token next, whose
        request allows speculation (``SamplingParams.can_speculate``) and whose backoff allows
        it (a sequence whose drafts were all rejected skips 1, 2, 4, ... chances). True if any
        sequence got drafts. With a draft model the drafts are placeholders (copies of the last
        token) that reserve the verify step's slots; the runner replaces them with the model's
        tokens once the step is scheduled (``DraftModel.propose``)."""
        assert self.speculative is not None
        t0 = time.perf_counter()
        found = False
        k = self.speculative.num_speculative_tokens
        for req in self.scheduler.running:
            if (req.num_pending or req.num_computed_tokens != req.num_tokens - 1 or not req.num_output_tokens
                    or not req.sampling_params.can_speculate or not self._draft_backoff.allow(req.request_id)):
                continue
            if self.proposer is None:
                req.draft_token_ids = [req.all_token_ids[-1]] * k
            else:
                req.draft_token_ids = self.proposer.propose(req.request_id, req.all_token_ids)
            found = found or bool(req.draft_token_ids)
        self.spec_stats.draft_seconds += time.perf_counter() - t0
        return found

    def _step(self, final_only: bool) -> list[RequestOutput]:
        """A speculative step when the proposer is on and the batch is small enough; with async
        scheduling it first finishes the step in flight (drafts need every token on the host),
        and after a probe that found no draft the next 1, 2, 4, ... (at most 16) steps run
        asynchronously without probing."""
        if self.speculative is None or not self._speculates_now():
            return self._launch_step(final_only, sync=not self.async_scheduling)
        if self.async_scheduling and not self._probe_backoff.allow("engine"):
            return self._launch_step(final_only, sync=False)
        drained: list[RequestOutput] = []
        if self._in_flight is not None:  # drafts need every token known: finish the step in flight
            drained = self._finish_step(*self._in_flight, final_only)
            self._in_flight = None
        found = self._propose()
        if self.async_scheduling:
            self._probe_backoff.record("engine", found)
        return drained + self._launch_step(final_only, sync=found or not self.async_scheduling)

    def _constrained_targets(self, out: SchedulerOutput) -> list[Request]:
        return [req for s in out.seqs for req in s.samplers if req.sampling_params.structured_outputs is not None]

    def _masks(self, targets: list[Request]):
        """The allowed tokens of each constrained target, from its grammar after its delivered
        tokens: call once the step before has been collected (its tokens are delivered)."""
        return self.matchers.allowed_batch([(r.request_id, r.sampling_params.structured_outputs, r.output_token_ids)
                                            for r in targets if not r.is_finished])

    def _launch_step(self, final_only: bool, sync: bool) -> list[RequestOutput]:
        """Schedule and launch a step. With constrained targets, the forward pass is queued
        first; then the step in flight is collected (its tokens reach the grammars), the masks
        are computed while the device runs the forward pass, and the sampling is queued."""
        if self.offload is not None:
            self.offload.install_ready()
        if self._adopter.busy:
            self._adopter.collect()
        if self.pins is not None and self.pins.pins:
            self.pins.expire(time.monotonic())
        out = self.scheduler.schedule()
        self._open_steps.append(out)
        if self.schedule_hook is not None:
            self.schedule_hook(out)
        if self.offload is not None:
            self.offload.dispatch(out.loads)
            if out.is_empty and not out.finished_ids and self._in_flight is None:
                self._open_steps.pop()
                self.offload.install_ready(block=True)  # nothing to run until a load or lookup lands
                return []
        if not out.is_empty:
            self.steps += 1
            self.batched_tokens += out.num_batched_tokens
        t0 = time.perf_counter()
        constrained = self._constrained_targets(out) if self._constrained else []
        step = describe_step(out)
        if self.kv.encoder is not None and any(seq.media for seq in step.seqs):
            step.encodings = plan_encodings(self.kv.encoder, (m for seq in step.seqs for m in seq.media),
                                            self._encoding_bytes)
        launched = self.runner.launch(step, defer_sampling=True) if constrained else self.runner.launch(step)
        drained: list[RequestOutput] = []
        if constrained:
            if self._in_flight is not None:
                drained = self._finish_step(*self._in_flight, final_only)
                self._in_flight = None
            self.runner.sample_deferred(launched, *self._masks(constrained))
        if sync:
            outputs = drained + self._finish_step(out, launched, final_only)
            if launched.verify is not None:
                self.spec_stats.verify_steps += 1
                self.spec_stats.verify_seconds += time.perf_counter() - t0 - launched.draft_seconds
                self.spec_stats.draft_seconds += launched.draft_seconds
            return outputs
        previous, self._in_flight = self._in_flight, (out, launched)
        outputs = drained + (self._finish_step(*previous, final_only) if previous is not None else [])
        if out.is_empty:  # nothing in flight: report its finished requests now
            self._in_flight = None
            outputs += self._finish_step(out, launched, final_only)
        return outputs

    def _finish_step(self, out: SchedulerOutput, launched: LaunchedStep, final_only: bool) -> list[RequestOutput]:
        sampled = self.runner.collect(launched)
        for rid, (first, rows) in self.runner.collect_prompt_logprobs(launched).items():
            ureq = self._user_request_of.get(rid)
            if ureq is not None and ureq.prompt_logprobs is not None:
                plps = ureq.prompt_logprobs
                for pos, row in enumerate(rows, first):
                    if plps[pos] is None:  # a recompute after preemption keeps the first values
                        plps[pos] = {t: Logprob(lp, rank, None, t, self._token_text) for t, (lp, rank) in row.items()}
        got = self.scheduler.update_from_output(
            out, {r: s.spec_token_ids or s.token_id for r, s in sampled.items()})
        if launched.verify is not None:
            for s in out.seqs:
                st = sampled.get(s.request.request_id)
                if s.draft_token_ids and st is not None:
                    accepted = len(st.spec_token_ids or ()) - 1
                    self.spec_stats.record(len(s.draft_token_ids), accepted)
                    self._draft_backoff.record(s.request.request_id, accepted > 0)
        if self.offload is not None:
            self.offload.after_step()
        now = time.monotonic()
        touched: dict[str, _UserRequest] = {}
        failed: dict[str, tuple[_UserRequest, str]] = {}
        for seq in got:
            ureq = self._user_request_of.setdefault(seq.request_id, self._user_requests[seq.parent_id])
            if ureq.request_id in failed:
                continue
            try:
                self._take_token(ureq, seq, sampled[seq.request_id], now)
            except Exception as e:  # this request's own host-side work (text, grammar): fail it alone
                log.exception("request %s failed after its step", ureq.request_id)
                failed[ureq.request_id] = (ureq, _error_reason(e))
                touched.pop(ureq.request_id, None)
                continue
            touched[ureq.request_id] = ureq
        for rid in out.finished_ids:
            ureq = self._user_request_of.get(rid)
            if ureq is not None and ureq.request_id in self._user_requests:
                touched[ureq.request_id] = ureq
        outputs = [self._fail_request(ureq, reason, now) for ureq, reason in failed.values()]
        for ureq in touched.values():
            finished = ureq.finished()
            if final_only and not finished:
                continue
            outputs.append(self._output(ureq, finished, now))
            if finished:
                self._user_requests.pop(ureq.request_id, None)
                self._forget(ureq)
        if self._pending_pins:
            self._take_pins([o.request_id for o in outputs if o.finished])
        self._open_steps = [o for o in self._open_steps if o is not out]
        self._produced += outputs
        return outputs

    def _take_token(self, ureq: _UserRequest, seq: Request, st, now: float) -> None:
        """A sequence's new token(s), on the host: its grammar, text, stop strings, logprobs."""
        ureq.seqs.setdefault(seq.sample_index, seq)
        ureq.first_token_time = ureq.first_token_time or now
        spec = seq.sampling_params.structured_outputs
        if (spec is not None and self.matchers.advance(seq.request_id, spec, seq.output_token_ids)
                and not seq.is_finished):  # the grammar is complete (nothing more may follow) or broke
            broke = self.matchers.error(seq.request_id)
            if broke is not None:  # the output so far is not known to match: never a plain "stop"
                log.warning("request %s: its output constraint failed after %d tokens: %s",
                            seq.request_id, len(seq.output_token_ids), broke)
                seq.stop_reason = f"{spec.field_name}: the constraint failed during generation ({broke})"
            self.scheduler.finish_request(
                seq.request_id, RequestStatus.FINISHED_STOPPED if broke is None else RequestStatus.FINISHED_ABORTED)
        self._record(ureq, seq, st)

    # -- failures ------------------------------------------------------------------------
    def _fail_open_steps(self, error: Exception) -> list[RequestOutput]:
        """A step raised: every request with a sequence in a step not yet finished (the one that
        raised and, with async scheduling, the one in flight, whose tokens the next one reads on
        the device) ends as ``FINISHED_ERROR``; the engine goes on with the others. Safe for the
        cache: a step's blocks enter the prefix index only once its output is applied
        (``Scheduler.update_from_output``), so no block a failed step wrote is ever reused.
        Outputs of steps that finished earlier in this call are returned first. An error
        outside any step (scheduling itself) leaves the engine's state unknown and is raised."""
        outs, self._open_steps = self._open_steps, []
        if not outs:
            raise error
        self._in_flight = None
        self.failed_steps += 1
        log.error("engine step failed; failing the requests it held", exc_info=error)
        reason, now = _error_reason(error), time.monotonic()
        parents = dict.fromkeys(r.parent_id for out in outs for s in out.seqs for r in (s.request, *s.samplers))
        outputs = list(self._produced)
        for pid in parents:
            ureq = self._user_requests.get(pid)
            if ureq is not None:
                outputs.append(self._fail_request(ureq, reason, now))
                continue
            self._finish_sequences(pid, RequestStatus.FINISHED_ERROR)  # the engine's own work (segment fills)
        return outputs

    def _fail_request(self, ureq: _UserRequest, reason: str, now: float) -> RequestOutput:
        """End every unfinished sequence of a request as ``FINISHED_ERROR`` with ``reason`` as
        its ``stop_reason`` (blocks freed at once) and return its final output."""
        for seq in self._finish_sequences(ureq.request_id, RequestStatus.FINISHED_ERROR):
            ureq.seqs.setdefault(seq.sample_index, seq)
        for seq in ureq.seqs.values():
            if not seq.is_finished or seq.status is RequestStatus.FINISHED_ERROR:
                seq.status, seq.stop_reason = RequestStatus.FINISHED_ERROR, reason
        pending = self._pending_pins.pop(ureq.request_id, None)
        if pending is not None and pending.on_done is not None:
            pending.on_done(RuntimeError(reason))
        self._user_requests.pop(ureq.request_id, None)
        self._forget(ureq)
        return self._output(ureq, True, now)

    def _record(self, ureq: _UserRequest, seq: Request, st) -> None:
        i = seq.sample_index
        detok = ureq.detoks.get(i)
        if detok is None:
            detok = ureq.detoks[i] = IncrementalDetokenizer(self.tokenizer, ureq.params)
        if st.logprob is not None:
            ureq.cum_logprob[i] = ureq.cum_logprob.get(i, 0.0) + st.logprob
            text = self._token_text
            entry = {st.token_id: Logprob(st.logprob, st.rank, None, st.token_id, text)}
            for rank, (t, lp) in enumerate(st.top_logprobs or (), 1):
                entry.setdefault(t, Logprob(lp, rank, None, t, text))
            ureq.logprobs.setdefault(i, []).append(entry)
        ids = seq.output_token_ids
        new = len(ids) - detok.seen
        if new > 1 and ureq.params.stop_strings:  # a verify step's tokens, one at a time as plain decoding
            for end in range(len(ids) - new + 1, len(ids) + 1):  # sees them: none after a stop string
                stop = detok.update(ids[:end])
                if stop is not None:
                    extra = len(ids) - end
                    if extra:
                        del seq.output_token_ids[end:]
                        del seq.all_token_ids[len(seq.all_token_ids) - extra:]
                    break
        else:
            stop = detok.update(ids)
        if stop is not None:
            seq.stop_reason = stop
            if seq.is_finished:
                seq.status = RequestStatus.FINISHED_STOPPED
            else:
                self.scheduler.finish_request(seq.request_id, RequestStatus.FINISHED_STOPPED)
        elif seq.is_finished:
            detok.flush()

    def _output(self, ureq: _UserRequest, finished: bool, now: float) -> RequestOutput:
        comps = []
        for i in sorted(ureq.seqs):
            seq, detok = ureq.seqs[i], ureq.detoks.get(i)
            comps.append(CompletionOutput(
                index=i, text=detok.text if detok else "", token_ids=list(seq.output_token_ids),
                cumulative_logprob=ureq.cum_logprob.get(i), logprobs=ureq.logprobs.get(i),
                finish_reason=seq.status.value if seq.is_finished else None,
                stop_reason=seq.stop_reason))
        metrics = {"arrival_time": ureq.arrival_time, "first_token_time": ureq.first_token_time,
                   "cached_tokens_by_source": dict(ureq.seqs[0].cached_by_source)}
        if finished:
            metrics["finished_time"] = now
        return RequestOutput(ureq.request_id, ureq.prompt, ureq.prompt_token_ids, comps, finished,
                             num_cached_tokens=max(0, ureq.seqs[0].num_cached_tokens), metrics=metrics,
                             prompt_logprobs=None if ureq.prompt_logprobs is None else list(ureq.prompt_logprobs))

    # -- observability -------------------------------------------------------------------
    def stats(self) -> dict:
        s = {**self.kv.stats(), "num_blocks": self.kv.pages.num_pages, "kv_cache_dtype": self.kv_cache_dtype,
             "running": len(self.scheduler.running), "waiting": self.scheduler.num_waiting(),
             "loading": len(self.scheduler.loading), "steps": self.steps, "step_seconds": self.step_seconds,
             "batched_tokens": self.batched_tokens, "failed_steps": self.failed_steps}
        if self.scheduler.segments is not None:
            s["segment_saved_seconds"] = self.segment_saved_seconds
        if self.tiers is not None:
            s["tiers"] = self.tiers.usage()
        if self._adopter.used:
            s.update(self._adopter.stats())
        if self.media is not None:
            cache = self.kv.encoder.stats() if self.kv.encoder is not None else {
                "encoder_cache_hits": 0, "encoder_cache_evictions": 0, "encoder_cache_entries": 0,
                "encoder_cache_bytes": 0, "encoder_cache_pages": 0, "encoder_cache_capacity_bytes": 0}
            s["encoder"] = {"encoder_runs": self.runner.encoder_runs,
                            "encodings_received": self.runner.encodings_received, **cache}
        if self.speculative is not None:
            s["speculative"] = {"method": self.speculative.method,
                                "num_speculative_tokens": self.speculative.num_speculative_tokens,
                                **self.spec_stats.as_dict()}
        return s

    def reset_prefix_cache(self) -> int:
        return self.kv.reset_prefix_cache()

    def adopt_blocks(self, hashes: list[BlockHash], parent: BlockHash | None, rows: torch.Tensor,
                     depth: int = 0) -> int:
        """Cache blocks another engine computed (``BlockAdopter.adopt``); between steps only."""
        return self._adopter.adopt(hashes, parent, rows, depth)

    def warm_adoption(self, rows: torch.Tensor) -> None:
        """Any thread: rows that ``adopt_blocks`` will copy from another GPU have arrived; wake
        the link now (``BlockAdopter.warm``)."""
        self._adopter.warm(rows)

    def drain_kv_events(self) -> KVEventBatch | None:
        """The prefix cache's events since the last call as the next numbered batch (None if
        none; ``kv_events`` must be on). Call from the engine's thread, between steps."""
        if self.kv_events is None:
            raise RuntimeError("kv_events is off: start the engine with kv_events=True")
        return self.kv_events.drain()

    def kv_event_snapshot(self) -> KVSnapshot:
        """Every cached hash after draining, for a subscriber that missed a batch."""
        self.drain_kv_events()  # (a subscriber resyncing from the snapshot needs no earlier batch)
        return self.kv.event_snapshot()

    def top_prefixes(self, n: int = 10) -> list[dict]:
        """The ``n`` most-hit cached prefixes (``KVCacheManager.top_prefixes``: hashes and
        counts, no tokens). Scans the cached blocks: call between steps, on demand."""
        return self.kv.top_prefixes(n)
