"""The tensor side of the engine: owns the model, the paged K/V tensors and the sampler."""
from __future__ import annotations

import gc
import mmap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvos.cache.layout import CacheLayout
from kvos.cache.spec import MambaStateSpec
from kvos.core.step import SampleTarget, StepDescription
from kvos.kernels.kv_quant import TORCH_DTYPES as QUANTIZED_TORCH_DTYPES
from kvos.models.attention import AttentionBackend, AttentionMetadata, KVCache
from kvos.models.loader import load_model
from kvos.models.ops import triton_enabled
from kvos.models.state import StateCache, state_metadata
from kvos.models.tensor_parallel import TPGroup, shard_plan
from kvos.worker import peer_channel
from kvos.worker.block_digest import page_digests
from kvos.worker.cuda_graphs import DecodeGraphs
from kvos.worker.device_rows import DeviceRows
from kvos.worker.draft_model import DraftModel
from kvos.worker.host_copies import as_words, to_device
from kvos.worker.peer_channel import PeerRows
from kvos.worker.sampler import (
    PendingPromptLogprobs,
    PendingSamples,
    PromptLogprobRows,
    SampledToken,
    Sampler,
    SampleRow,
    SeedStream,
    prompt_logprobs,
)
from kvos.worker.segment_copies import apply_segment_copies
from kvos.worker.spec_verify import DraftRows, PendingVerify, launch_verify
from kvos.worker.torch_attention import TorchReferenceBackend

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
          "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


@dataclass
class LaunchedStep:
    """A step queued on the device: its sampling targets and their samples in flight, and the
    prompt logprobs of its prefill chunks that asked for them."""

    targets: list[str]
    samples: PendingSamples | None
    prompt_logprobs: PendingPromptLogprobs | None = None
    verify: PendingVerify | None = None
    """Speculative drafts being verified (their targets are not in ``targets``)."""
    draft_seconds: float = 0.0
    """Time the draft model took to propose this step's drafts."""
    deferred: tuple[torch.Tensor, list[SampleRow]] | None = None
    """Logits and rows whose sampling waits for ``ModelRunner.sample_deferred`` (structured
    outputs' masks, computed on the host while the forward pass runs)."""


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def default_backend(device: torch.device) -> AttentionBackend:
    """Triton kernels on a CUDA GPU where triton is installed (unless ``KVOS_TRITON=0``); on the
    CPU the C decode kernel where it is built (``CpuBackend``); the torch reference elsewhere."""
    if device.type == "cuda" and triton_enabled():
        from kvos.worker.triton_attention import TritonBackend

        return TritonBackend()
    if device.type == "cpu":
        from kvos.worker.cpu_attention import CpuBackend

        return CpuBackend()
    return TorchReferenceBackend()


def zeroed_bytes(n: int, device: torch.device) -> torch.Tensor:
    """``n`` zero bytes (uint8) on ``device``. On the CPU an anonymous private mapping, which the
    kernel zero-fills page by page on first touch: a pool costs the memory and time of the pages
    its blocks use, where ``torch.zeros`` writes every byte up front (about 1.5 s for the default
    2 GiB on the 2-core VM). The tensor keeps the mapping alive."""
    if torch.device(device).type != "cpu" or n == 0:
        return torch.zeros(n, dtype=torch.uint8, device=device)
    return torch.frombuffer(mmap.mmap(-1, n), dtype=torch.uint8)


def token_minor(v: torch.Tensor) -> torch.Tensor:
    """``v`` ``[blocks, block_size, kv_heads, head_dim]`` (contiguous within a block) viewed over
    the same bytes as token-minor: within a block, head h's rows lie as ``[head_dim,
    block_size]`` (``stride(1) == 1``), the layout in which 8-bit attention tiles need no
    transposition (``kvos.kernels.tile_attention.v_pages``)."""
    _, bs, kvh, d = v.shape
    assert v.stride()[1:] == (kvh * d, d, 1), "V must be contiguous within a block"
    return v.as_strided(v.shape, (v.stride(0), 1, d * bs, bs))


class ModelRunner:
    """Executes one scheduled step: copy-on-write copies, the forward pass, sampling.

    The KV pool is one zero-initialised buffer of ``num_pages`` large pages (so padding and the
    null block are finite). Cache group g views it as ``[num_blocks_g, layer_slots_g, 2,
    block_size, kv_heads, head_dim]`` (page-major: one block holds every layer of its group);
    block ids of group g index the first dimension, and layer l reads the slot its group gives
    it (``kv_layers[l]``). A quantized group's page holds its float32 scales ``[layer_slots_g, 2,
    kv_heads, block_size]`` after the data (``KVCacheSpec.data_bytes``), so a block's bytes are
    self-contained, and its V is token-minor (``token_minor``): each layer slot's V holds
    ``[kv_heads, head_dim, block_size]``, which the attention kernels read a block at a time.
    """

    def __init__(self, model_path: Path, dtype: torch.dtype, device: torch.device,
                 backend: AttentionBackend | None = None, random_weights: bool = False,
                 block_weights: bool = True, tp: TPGroup | None = None) -> None:
        self.device = device
        self.dtype = dtype
        self.tp = tp if tp is not None and tp.size > 1 else None
        """This runner's rank of a tensor-parallel engine (None: the whole model). Safety rule:
        every rank is given the same calls with the same steps (``kvos.worker.parallel_runner``),
        since each forward pass and sampling step runs collectives."""
        self.cfg, self.model = load_model(model_path, dtype, device, random_weights,
                                          block_weights and self.tp is None, self.tp)
        self.kv_heads = (shard_plan(self.cfg, self.tp.rank, self.tp.size).kv_heads if self.tp is not None
                         else self.cfg.num_kv_heads)
        """K/V heads this rank's pool holds per layer (``cfg.num_kv_heads`` without tensor parallelism)."""
        self.backend = backend or default_backend(device)
        self.graphs: DecodeGraphs | None = None
        self.mixed_graphs = None
        """``MixedStepGraphs`` once captured (a GPU with triton)."""
        self.sampler = Sampler()
        self.layout: CacheLayout | None = None
        self.kv_buffer: torch.Tensor | None = None
        self.group_caches: list[torch.Tensor] = []
        """Per cache group: ``[num_blocks, layer_slots, 2, block_size, kv_heads, head_dim]`` (a
        quantized group's V slots hold ``[kv_heads, head_dim, block_size]``: read them through
        ``kv_layers``)."""
        self.group_scales: list[torch.Tensor | None] = []
        """Per quantized cache group: its float32 scales ``[num_blocks, layer_slots, 2, block_size, kv_heads]``."""
        self.group_pages: list[torch.Tensor] = []
        """Per cache group: its blocks as ``uint8 [num_blocks, page_bytes]`` rows (data and scales)."""
        self.kv_layers: list[KVCache] = []
        """Per model layer: its (K, V) views ``[num_blocks, block_size, kv_heads, head_dim]``
        (V token-minor in quantized groups: ``token_minor``)."""
        self.layer_group: list[int] = []
        self._is_state: list[bool] = []
        """Per cache group: True when it holds Mamba state pages (``StateMetadata``, not attention's)."""
        self.block_size = 0
        self._generators: dict[str, torch.Generator] = {}
        self._shared_open: list[tuple] = []
        """Other processes' rows mapped by ``write_shared_rows``, until their copies have run."""
        self.shared_copy_bytes = 0
        self.shared_copy_s = 0.0
        self._seed_streams: dict[str, SeedStream] = {}
        self._last_tokens: torch.Tensor | None = None
        self._last_targets: list[str] = []
        """Device tokens sampled by the last launch, and the target of each row."""
        self.draft: DraftModel | None = None
        """The speculative draft model, if drafts come from one (``set_draft``)."""
        self.logits_hook: Callable[[list[str], torch.Tensor], None] | None = None
        """Called with (request ids, float32 logits rows) each step before sampling; a debugging
        and testing aid that must not modify the tensor."""
        self.encoder_slot_bytes = 0
        """The pool's encoder slots' size (``EncoderPages``; set by the engine), 0: none."""
        self.encoder_runs = 0
        """Images run through the encoder."""
        self.encodings_received = 0
        """Encodings an encoder engine computed, stored here as if encoded (``MediaItem.encoded``)."""
        self.hidden_hook: Callable[[list[tuple[str, int]], torch.Tensor], None] | None = None
        """Called after each forward pass with ((request id, position) per row, the final hidden
        states ``[rows, hidden]``): an aid for benchmarks (``kvos bench segments`` computes the
        logits of the rows it wants with ``model.compute_logits``); must not modify them."""

    @torch.inference_mode()
    def profile_kv_budget(self, gpu_memory_utilization: float, max_num_batched_tokens: int) -> int:
        """Bytes left for the KV pool on this GPU: ``gpu_memory_utilization`` of its memory minus
        what other processes and the CUDA context hold, the weights, and the peak activations of
        one prefill step of ``max_num_batched_tokens`` tokens (run here on a scratch cache)."""
        c, dev = self.cfg, self.device
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        bs = 16
        nb = -(-max_num_batched_tokens // bs) + 1
        scratch = torch.zeros(c.num_layers, 2, nb, bs, self.kv_heads, c.head_dim, dtype=self.dtype, device=dev)
        layers: list = [KVCache(scratch[i, 0], scratch[i, 1]) for i in range(c.num_layers)]
        n = max_num_batched_tokens
        if c.mamba is not None:  # Mamba layers: one sequence's state, read from nothing, written to block 1
            m = c.mamba
            conv = torch.zeros(2, m.conv_dim, m.conv_width, device=dev)
            ssm = torch.zeros(2, m.num_heads, m.head_dim, m.state_size, device=dev)
            for i in c.mamba_layers:
                layers[i] = StateCache(conv, ssm)
        meta = AttentionMetadata(
            slot_mapping=torch.arange(bs, bs + n, device=dev),
            block_tables=torch.arange(1, nb, dtype=torch.int32, device=dev)[None, :],
            seq_lens=torch.tensor([n], dtype=torch.int32, device=dev), query_lens_list=[n], seq_lens_list=[n],
            num_decodes=0, block_size=bs, prefill_start_loc=torch.tensor([0, n], dtype=torch.int32, device=dev),
            max_prefill_len=n)
        ids = torch.randint(0, c.vocab_size, (n,), device=dev)
        state_meta = state_metadata(bs, [0], [n], [[0] * (nb - 2) + [1]], 0)
        metas = [state_meta if c.mamba is not None and i in c.mamba_layers else meta for i in range(c.num_layers)]
        hidden = self.model(ids, torch.arange(n, device=dev), layers, metas, self.backend)
        self.model.compute_logits(hidden[: min(n, 256)])
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev) - scratch.numel() * scratch.element_size()
        del scratch, hidden
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(dev)
        others = total - free - torch.cuda.memory_reserved(dev)
        return max(0, int(total * gpu_memory_utilization - others - peak))

    @torch.inference_mode()
    def time_all_reduce(self, rows: int, reps: int = 20) -> float:
        """Tensor parallelism: seconds of one all-reduce of ``[rows, hidden]`` in the model's dtype
        (what each ``o_proj`` and ``down_proj`` sums), as the decode graphs run it: on a GPU a
        CUDA graph of 32 back to back, the median of ``reps`` replays over 32 (on the CPU the
        median of host-timed calls). Every rank must call it."""
        assert self.tp is not None, "one rank: nothing to reduce"
        import statistics
        import time

        x = torch.ones(rows, self.cfg.hidden_size, dtype=self.dtype, device=self.device)
        if self.device.type != "cuda":
            times = []
            for _ in range(reps + 3):
                t = time.perf_counter()
                self.tp.all_reduce(x)
                times.append(time.perf_counter() - t)
            return statistics.median(times[3:])
        n = 32
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(3):
                self.tp.all_reduce(x)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(n):
                self.tp.all_reduce(x)
        times = []
        for _ in range(reps + 3):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graph.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3 / n)
        return statistics.median(times[3:])

    def capture_cuda_graphs(self, max_num_seqs: int, max_model_len: int, max_context: int = 8192,
                            mixed_tokens: int = 0) -> None:
        """CUDA graphs for decode steps of up to ``max_num_seqs`` sequences of up to
        ``min(max_model_len, max_context)`` tokens (longer or larger steps run eagerly). A graph's
        decode kernel splits the context for the longest table it can hold, so a larger
        ``max_context`` serves long contexts at graph speed and short ones a little slower.
        ``mixed_tokens`` > 0: also piecewise graphs (``MixedStepGraphs``) for other steps of up
        to that many tokens, where the model and backend allow (Llama family)."""
        assert self.kv_buffer is not None, "allocate_kv_cache first"
        max_blocks = -(-min(max_model_len, max_context) // self.block_size)
        with torch.inference_mode():
            state = frozenset(g for g, is_state in enumerate(self._is_state) if is_state)
            self.graphs = DecodeGraphs(self.model, self.kv_layers, self.layer_group, len(self.group_caches),
                                       self.backend, self.block_size, min(max_num_seqs, 256), max_blocks, state)
            if self.draft is not None:
                self.draft.capture_graphs(len(self.group_caches), self.backend, self.block_size,
                                          min(max_num_seqs, 256), max_blocks)
            if mixed_tokens > 0:
                from kvos.worker.mixed_graphs import MixedStepGraphs  # imports triton

                if MixedStepGraphs.supports(self.model, self.backend):
                    self.mixed_graphs = MixedStepGraphs(self.model, self.kv_layers, self.layer_group,
                                                        len(self.group_caches), self.backend, mixed_tokens)

    def release_cuda_graphs(self) -> None:
        """Drop every captured graph (steps run eagerly after). A tensor-parallel rank must do
        this before leaving its NCCL group: graphs that captured collectives hold references on
        the communicator, and its teardown waits for them to be released."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.graphs = self.mixed_graphs = None
        if self.draft is not None:
            self.draft.graphs = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def set_draft(self, draft: DraftModel) -> None:
        """Draft speculative tokens with ``draft`` (before ``allocate_kv_cache``, which binds its
        K/V: a group of its own, or the target's first layers')."""
        self.draft = draft

    def allocate_kv_cache(self, layout: CacheLayout, num_pages: int) -> None:
        """One zeroed buffer of ``num_pages`` large pages, viewed per group and per layer."""
        c = self.cfg
        self.layout = layout
        self.block_size = layout.block_size
        self.kv_buffer = zeroed_bytes(num_pages * layout.large_page_bytes, self.device)
        self.group_caches, self.group_scales, self.group_pages = [], [], []
        for g, group in enumerate(layout.groups):
            s = group.spec
            nb = num_pages * layout.blocks_per_large_page(g)
            if isinstance(s, MambaStateSpec):  # states are viewed per layer (_layer_views)
                self.group_caches.append(self.kv_buffer.view(nb, s.page_bytes))
                self.group_pages.append(self.group_caches[-1])
                self.group_scales.append(None)
                continue
            storage = QUANTIZED_TORCH_DTYPES.get(s.dtype) or parse_dtype(s.dtype)
            elem = torch.empty(0, dtype=storage).element_size()
            shape = (nb, s.num_layers, 2, s.block_size, s.num_kv_heads, s.head_dim)
            assert s.page_bytes % elem == 0
            inner = torch.empty(shape[1:], device="meta").stride()
            self.group_caches.append(self.kv_buffer.view(storage).as_strided(shape, (s.page_bytes // elem, *inner)))
            self.group_pages.append(self.kv_buffer.view(nb, s.page_bytes))
            scales = None
            if s.quantized:
                assert s.page_bytes % 4 == 0 and s.data_bytes % 4 == 0
                # stored [layer slots, 2, kv_heads, block_size]: one head's scales of a block are
                # contiguous (coalesced loads in the attention kernels); viewed [.., block_size, kv_heads]
                sshape = shape[:-1]
                kvh, bs = s.num_kv_heads, s.block_size
                scales = self.kv_buffer.view(torch.float32).as_strided(
                    sshape, (s.page_bytes // 4, 2 * kvh * bs, kvh * bs, 1, bs), s.data_bytes // 4)
            self.group_scales.append(scales)
        self._is_state = [isinstance(g.spec, MambaStateSpec) for g in layout.groups]
        self.kv_layers, self.layer_group = self._layer_views(layout, range(c.num_layers))
        d = self.draft
        if d is not None:
            if d.owns_kv:  # the draft's layers are numbered after the target's
                d.bind(*self._layer_views(layout, range(c.num_layers, c.num_layers + d.cfg.num_layers)))
            else:
                d.bind(self.kv_layers[: d.num_layers], self.layer_group[: d.num_layers])

    def _layer_views(self, layout: CacheLayout, layers: range) -> tuple[list[KVCache], list[int]]:
        """Each layer's (K, V) views into its group's pages, and its group."""
        kv_layers, layer_group = [], []
        for layer in layers:
            g, slot = layout.layer_slot(layer)
            view, scales = self.group_caches[g], self.group_scales[g]
            spec = layout.groups[g].spec
            if isinstance(spec, MambaStateSpec):
                kv_layers.append(self._state_views(spec, view.shape[0], slot))
            elif scales is None:
                kv_layers.append(KVCache(view[:, slot, 0], view[:, slot, 1]))
            else:
                kv_layers.append(KVCache(view[:, slot, 0], token_minor(view[:, slot, 1]),
                                         scales[:, slot, 0], scales[:, slot, 1]))
            layer_group.append(g)
        return kv_layers, layer_group

    def _state_views(self, s: MambaStateSpec, num_blocks: int, slot: int) -> StateCache:
        """Layer slot ``slot``'s conv and SSM states in every block of a state group (float32)."""
        assert self.kv_buffer is not None and s.page_bytes % 4 == 0 and s.layer_bytes % 4 == 0
        words = self.kv_buffer.view(torch.float32)
        page, base = s.page_bytes // 4, slot * s.layer_bytes // 4
        conv = words.as_strided((num_blocks, s.conv_dim, s.conv_width), (page, s.conv_width, 1), base)
        ssm = words.as_strided((num_blocks, s.num_heads, s.head_dim, s.state_size),
                               (page, s.head_dim * s.state_size, s.state_size, 1), base + s.conv_floats)
        return StateCache(conv, ssm)

    READ_CHUNK_BYTES = 256 << 20
    """Most device memory ``read_blocks`` gathers into at once (before each device-to-host copy)."""

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across its group's layers, scales included (one row of ``read_blocks``)."""
        return self.block_pages().shape[1]

    def group_block_bytes(self, group: int) -> int:
        """``block_bytes`` of cache group ``group``'s blocks."""
        return self.block_pages(group).shape[1]

    def block_pages(self, group: int | None = None) -> torch.Tensor:
        """Cache group ``group``'s KV tensor as ``uint8 [num_blocks, block_bytes]`` (one row per
        block, page-major); ``None``: the only group's (a ValueError with several groups)."""
        if group is None:
            if len(self.group_pages) != 1:
                raise ValueError(f"this layout has {len(self.group_pages)} cache groups: pass group= to name one")
            group = 0
        return self.group_pages[group]

    def read_blocks(self, block_ids: list[int], digests_out: list[int] | None = None,
                    group: int | None = None) -> torch.Tensor:
        """The blocks' bytes as rows of a host ``uint8`` tensor ``[n, block_bytes]`` (each row
        a whole page: ``[num_layers, 2, block_size, kv_heads, head_dim]`` values of the cache
        dtype, a quantized cache's V token-minor (``token_minor``), then its scales), pinned
        when the pool is on a GPU: one gather and one device-to-host copy per
        ``READ_CHUNK_BYTES``; returns when the copy is complete.
        ``digests_out``, when given, is extended with each row's ``block_digests`` value,
        computed on the device. Only valid while the blocks' content is
        what their owner says: call before the blocks are handed to someone else. ``group``: the
        cache group the ids belong to (``block_pages``)."""
        pages = self.block_pages(group)
        n, bb = len(block_ids), pages.shape[1]
        idx = to_device(block_ids, torch.long, pages.device)
        if digests_out is not None:
            digests_out.extend(page_digests(pages, block_ids).tolist())
        if pages.device.type == "cpu":
            return pages[idx]
        host = torch.empty(n, bb, dtype=torch.uint8, pin_memory=True)
        words = as_words(pages)
        step = max(1, self.READ_CHUNK_BYTES // bb)
        for i in range(0, n, step):
            host[i: i + step].copy_(words[idx[i: i + step]].view(torch.uint8))
        return host

    def share_blocks(self, block_ids: list[int]) -> DeviceRows:
        """This runner's pages of the blocks, gathered into a new ``uint8 [n, block_bytes]`` tensor
        on the current stream (so after every step queued before) and shared by CUDA IPC for a
        process of this host; returns once the gather is complete. GPU only. Only valid while the
        blocks' content is what their owner says."""
        torch.cuda.ipc_collect()  # free rows that earlier receivers are done with
        pages = self.block_pages()
        rows = as_words(pages).index_select(0, to_device(block_ids, torch.long, pages.device)).view(torch.uint8)
        shared = DeviceRows.share(rows)
        torch.cuda.current_stream(self.device).synchronize()
        return shared

    def hold_blocks(self, block_ids: list[int]) -> PeerRows:
        """This runner's pages of the blocks, gathered into new rows held for one receiver that
        pulls them over a point-to-point channel (``peer_channel``: NCCL on a GPU, gloo on the
        CPU); returns once the gather is complete. Only valid while the blocks' content is what
        their owner says; the held rows are a copy, so the blocks may change after."""
        pages = self.block_pages()
        rows = as_words(pages).index_select(0, to_device(block_ids, torch.long, pages.device)).view(torch.uint8)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        box = peer_channel.outbox(self.device)
        ticket = box.hold(rows)
        return PeerRows([box.address], [ticket], rows.shape[0], rows.shape[1])

    def receive_peer_rows(self, rows: PeerRows, part: int = 0) -> torch.Tensor:
        """Part ``part`` of rows another engine holds (``hold_blocks``), pulled to this device;
        complete on return. Raises when the sender no longer holds them or the channel fails."""
        got = peer_channel.inbox(self.device).receive(rows, part)
        if got is None:
            raise RuntimeError("p2p: the sending engine no longer holds these rows (expired or restarted)")
        return got

    def write_peer_rows(self, block_ids: list[int], rows: PeerRows, positions: list[int], part: int = 0) -> None:
        """Fill ``block_ids`` from rows ``positions`` of part ``part`` of another engine's held
        rows (``receive_peer_rows``, unless ``rows.received`` holds them already, then
        ``write_blocks``' scatter). Same rules as ``write_blocks``."""
        got = rows.received if rows.received is not None else self.receive_peer_rows(rows, part)
        self._write_pages(block_ids, got if len(positions) == got.shape[0] else got[positions])
        if got.is_cuda:  # received on the channel's stream, read on this one
            got.record_stream(torch.cuda.current_stream(self.device))

    def write_shared_rows(self, block_ids: list[int], rows: DeviceRows, positions: list[int]) -> None:
        """Fill ``block_ids`` from rows ``positions`` of another process's shared rows (one peer
        copy of the span, then ``write_blocks``), queued on the current stream. The mapping of the
        sender's memory is kept until that copy has run (``_shared_open``), then dropped (the
        sender's memory is freed once every receiver is done). Same rules as ``write_blocks``."""
        self.collect_shared_copies()
        src = rows.open()
        lo, hi = positions[0], positions[-1] + 1
        span = torch.empty((hi - lo, src.shape[1]), dtype=src.dtype, device=self.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        span.copy_(src[lo:hi], non_blocking=True)  # (the sender's GPU may carry this device's label: UVA finds it)
        end.record()
        local = [i - lo for i in positions]
        self._write_pages(block_ids, span if len(local) == hi - lo else span[local])
        done = torch.cuda.Event()
        done.record()
        self._shared_open.append((start, end, done, src, span.numel()))

    def collect_shared_copies(self) -> None:
        """Drop the mappings whose copies have run, adding their bytes and device time to
        ``shared_copy_bytes`` / ``shared_copy_s`` (the link's rate, one rank's part)."""
        pending = []
        for start, end, done, src, nbytes in self._shared_open:
            if done.query():
                self.shared_copy_bytes += nbytes
                self.shared_copy_s += start.elapsed_time(end) / 1e3
            else:
                pending.append((start, end, done, src, nbytes))
        self._shared_open = pending

    def write_blocks(self, block_ids: list[int], rows: torch.Tensor, group: int | None = None) -> None:
        """Fill ``block_ids`` from ``rows`` (``uint8 [n, block_bytes]`` as ``read_blocks``
        returns, contiguous, on any device) with one device-side scatter, queued on the current
        stream. Only into blocks their request owns, and only rows read from a pool of the same
        cache spec (the hash root includes the KV dtype, so a tier never offers another's). A
        host ``rows`` is copied to the device first (asynchronously when pinned: torch keeps its
        memory until the copy is done). ``group``: as for ``read_blocks``."""
        self._write_pages(block_ids, rows, group)

    def _write_pages(self, block_ids: list[int], rows: torch.Tensor, group: int | None = None) -> None:
        """``write_blocks`` into this runner's own pages (a tensor-parallel rank's part)."""
        pages = self.block_pages(group)
        if rows.shape[1:] != pages.shape[1:]:
            raise ValueError(f"block rows of {rows.shape[1]} bytes do not fit pages of {pages.shape[1]}")
        src = rows.to(pages.device, non_blocking=True)
        words, src_words = as_words(pages), as_words(src)
        if words.dtype != src_words.dtype:
            words, src_words = pages, src
        words.index_copy_(0, to_device(block_ids, torch.long, pages.device), src_words)

    def _generator(self, t: SampleTarget) -> torch.Generator | None:
        seed = t.params.seed
        if seed is None or t.params.greedy:
            return None
        gen = self._generators.get(t.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed((seed + 0x9E3779B97F4A7C15 * t.sample_index) % (1 << 63))
            self._generators[t.request_id] = gen
        return gen

    def _seed_stream(self, t: SampleTarget) -> SeedStream | None:
        """A seeded sampling target's kernel seeds (``SeedStream``), keyed like its generator."""
        seed = t.params.seed
        if seed is None or t.params.greedy:
            return None
        stream = self._seed_streams.get(t.request_id)
        if stream is None:
            stream = self._seed_streams[t.request_id] = SeedStream(seed + 0x9E3779B97F4A7C15 * t.sample_index)
        return stream

    @staticmethod
    def _history(sr: SampleRow, t: SampleTarget, last_rows: dict[str, int]) -> None:
        """What the sampler needs to adjust ``t``'s logits: its generated tokens (the one the
        previous step sampled, not yet delivered with async scheduling, read on the device), its
        prompt (repetition penalty), its banned tokens (stop tokens before ``min_tokens``, bad
        words) and its bans that depend on the pending token (bad words)."""
        prev = t.prev_pending
        if prev > 1 or (prev == 1 and t.request_id not in last_rows):
            raise RuntimeError(f"request {t.request_id}: {prev} generated tokens are pending "
                               f"but the previous step sampled at most one")
        if t.output_ids is not None or t.ban_after:
            sr.pending_src = last_rows[t.request_id] if prev == 1 else -1
        if t.output_ids is not None:
            sr.output_ids = t.output_ids
            sr.prompt_ids = t.prompt_ids
        sr.ban_ids = t.ban_ids
        sr.ban_after = t.ban_after

    def _prepare(self, step: StepDescription):
        seqs = sorted(step.seqs, key=lambda s: s.num_new_tokens != 1)  # decodes first (stable)
        bs = self.block_size
        n = len(seqs)
        qlens = np.fromiter((s.num_new_tokens for s in seqs), np.int64, n)
        starts = np.fromiter((s.start for s in seqs), np.int64, n)
        seq_lens = starts + qlens
        G = len(self.group_caches)
        block_lists = [s.block_ids for s in seqs]  # per sequence, per group; every group's table is as long
        tables = np.zeros((G, n, max(len(b[0]) for b in block_lists)), np.int32)
        logit_rows, row_ids, sample_rows, targets, ids = [], [], [], [], []
        plp_rows: list[int] = []  # rows scoring the next prompt token (prompt logprobs)
        plp_entries: list[PromptLogprobRows] = []
        feed_dst, feed_src = [], []  # input positions whose token is still on the device
        drafts: list[DraftRows] = []
        last_rows: dict[str, int] | None = None
        t = 0
        for i, s in enumerate(seqs):
            known = s.token_ids
            ids.extend(known)
            if len(known) < s.num_new_tokens:
                if last_rows is None:
                    last_rows = {rid: row for row, rid in enumerate(self._last_targets)}
                rid = s.request_id
                if rid not in last_rows or s.num_new_tokens - len(known) != 1:
                    raise RuntimeError(f"request {rid}: an input token is pending but was not "
                                       f"sampled by the previous step")
                feed_dst.append(len(ids))
                feed_src.append(last_rows[rid])
                ids.append(0)
            for g, blocks in enumerate(block_lists[i]):
                tables[g, i, : len(blocks)] = blocks
            if s.prompt_logprobs is not None:  # row p scores prompt token p + 1 (the last prompt row samples)
                k, scored = s.prompt_logprobs
                plp_rows.extend(range(t, t + len(scored)))
                plp_entries.append(PromptLogprobRows(s.request_id, s.start + 1, scored, k))
            t += s.num_new_tokens
            if s.draft_token_ids:  # one sampling target, verified over the last k + 1 rows
                k = len(s.draft_token_ids)
                target = s.samplers[0]
                drafts.append(DraftRows(target.request_id, len(logit_rows), s.draft_token_ids, target.params,
                                        self._generator(target)))
                logit_rows.extend(range(t - 1 - k, t))
                row_ids.extend([s.request_id] * (k + 1))
            elif s.samplers:
                row = len(logit_rows)
                logit_rows.append(t - 1)
                row_ids.append(s.request_id)
                for target in s.samplers:
                    sr = SampleRow(row, target.params, self._generator(target),
                                   seed_stream=self._seed_stream(target))
                    if target.params.adjusts_logits:
                        if last_rows is None:
                            last_rows = {rid: row for row, rid in enumerate(self._last_targets)}
                        self._history(sr, target, last_rows)
                    sample_rows.append(sr)
                    targets.append(target.request_id)
        ends = np.cumsum(qlens)
        positions = np.arange(ends[-1]) - np.repeat(ends - qlens - starts, qlens)
        slots = tables[:, np.repeat(np.arange(n), qlens), positions // bs].astype(np.int64) * bs + positions % bs
        nd = int(np.count_nonzero(qlens == 1))
        if drafts and nd < n and all(s.num_new_tokens == 1 + len(s.draft_token_ids) for s in seqs):
            # a verify step without prefill: each token is a decode row of its own length with its
            # sequence's table, causal because every row's K/V is written before any row attends;
            # so the step is a decode batch and runs in the decode CUDA graphs
            tables = tables[:, np.repeat(np.arange(n), qlens)]
            seq_lens = positions + 1
            qlens = np.ones(len(positions), np.int64)
            n = nd = len(positions)
        prefill_loc = np.concatenate([[0], np.cumsum(qlens[nd:])])
        # one host-to-device copy for every int64 input of the step (and one for the tables)
        plp_targets = [tok for e in plp_entries for tok in e.token_ids]
        packed = np.concatenate([ids, positions, slots.reshape(-1), logit_rows, feed_dst, feed_src, seq_lens,
                                 prefill_loc, plp_rows, plp_targets]).astype(np.int64)
        packed = to_device(packed, torch.int64, self.device)
        T, L, F, P = len(ids), len(logit_rows), len(feed_dst), len(plp_rows)
        input_ids, pos_t = packed[:T], packed[T : 2 * T]
        slots_t = packed[2 * T : (2 + G) * T].view(G, T)
        o = (2 + G) * T
        logit_idx = packed[o : o + L]
        if F:
            assert self._last_tokens is not None
            dst, src = packed[o + L : o + L + F], packed[o + L + F : o + L + 2 * F]
            input_ids.index_copy_(0, dst, self._last_tokens.index_select(0, src))
        rest = packed[o + L + 2 * F : len(packed) - 2 * P].to(torch.int32)
        plp = None
        if P:
            plp = (plp_entries, packed[len(packed) - 2 * P : len(packed) - P], packed[len(packed) - P :])
        tables_t = to_device(tables, torch.int32, self.device)
        qlist, slist = qlens.tolist(), seq_lens.tolist()
        max_prefill = int(qlens[nd:].max()) if nd < n else 0
        metas = [AttentionMetadata(
            slot_mapping=slots_t[g], block_tables=tables_t[g], seq_lens=rest[:n], query_lens_list=qlist,
            seq_lens_list=slist, num_decodes=nd, block_size=bs, prefill_start_loc=rest[n:],
            max_prefill_len=max_prefill) if not self._is_state[g] else
            state_metadata(bs, starts.tolist(), qlist, [b[g] for b in block_lists], nd) for g in range(G)]
        return input_ids, pos_t, metas, tables_t, slots_t, logit_idx, row_ids, sample_rows, targets, plp, drafts

    @torch.inference_mode()
    def execute(self, step: StepDescription) -> dict[str, SampledToken]:
        """Run one step; returns a sampled token for every sampling target of the step."""
        return self.collect(self.launch(step))

    @torch.inference_mode()
    def launch(self, step: StepDescription, defer_sampling: bool = False) -> LaunchedStep:
        """Queue one step on the device (copy-on-write copies, forward pass, sampling) without
        waiting for it. Inputs still pending on the host (async scheduling) are read on the
        device from the tokens sampled by the previous ``launch``, which must therefore be the
        step before this one. Safety rule: launches are serialised on one stream, so a step
        sees every write of the steps launched before it. ``defer_sampling``: queue the forward
        pass only; ``sample_deferred`` (with the step's masks) must follow before the next launch."""
        for rid in step.finished_ids:
            self._generators.pop(rid, None)
            self._seed_streams.pop(rid, None)
        assert self.kv_buffer is not None, "allocate_kv_cache first"
        for group, src, dst in step.copies:
            self.group_pages[group][dst].copy_(self.group_pages[group][src])
        if step.segment_copies:
            apply_segment_copies(step.segment_copies, self.kv_layers, self.layer_group, self.model.layer_rotary,
                                 self.block_size)
        if step.is_empty:
            return LaunchedStep([], None)
        draft_s = 0.0
        if self.draft is not None:
            t0 = self.draft.seconds
            self.draft.propose(step, self.block_size, self.backend, self.device)
            draft_s = self.draft.seconds - t0
        (input_ids, positions, metas, tables, slots, logit_idx, row_ids, sample_rows, targets,
         plp, drafts) = self._prepare(step)
        media = (self._media_inputs(step, metas) if self.cfg.vision is not None and any(s.media for s in step.seqs)
                 else None)
        meta, g = metas[0], self.graphs
        if g is not None and media is None and meta.num_decodes == len(meta.query_lens_list) and \
                g.can_run(meta.num_decodes, tables.shape[2]):
            hidden = g.run(input_ids, positions, slots, tables, meta.seq_lens)
        elif media is not None:
            layer_metas = [metas[g] for g in self.layer_group]
            hidden = self.model(input_ids, positions, self.kv_layers, layer_metas, self.backend, media_embeds=media)
        else:
            layer_metas = [metas[g] for g in self.layer_group]
            mg = self.mixed_graphs
            if mg is not None and mg.can_run(input_ids.shape[0]):
                hidden = mg.run(input_ids, positions, slots, layer_metas)
            else:
                hidden = self.model(input_ids, positions, self.kv_layers, layer_metas, self.backend)
        if self.hidden_hook is not None:
            order = sorted(step.seqs, key=lambda s: s.num_new_tokens != 1)  # _prepare's row order
            self.hidden_hook([(s.request_id, s.start + i) for s in order for i in range(s.num_new_tokens)], hidden)
        if self.draft is not None:
            self.draft.fill_kv(input_ids, positions, metas, self.backend, slots, tables)
        pending_plp = self._launch_prompt_logprobs(hidden, *plp) if plp is not None else None
        if not row_ids:
            return LaunchedStep([], None, pending_plp)
        logits = self.model.compute_logits(hidden[logit_idx])
        if self.logits_hook is not None:
            self.logits_hook(row_ids, logits)
        verify = launch_verify(logits, drafts) if drafts else None
        if not sample_rows:
            return LaunchedStep([], None, pending_plp, verify, draft_s)
        if self.tp is not None and self.tp.rank > 0:  # rank 0 samples (deferred or not) and sends its tokens
            self._last_tokens = self.tp.broadcast(torch.empty(len(targets), dtype=torch.int64, device=self.device))
            self._last_targets = targets
            return LaunchedStep([], None)
        if defer_sampling:
            return LaunchedStep(targets, None, pending_plp, verify, draft_s, (logits, sample_rows))
        pending = self.sampler.launch(logits, sample_rows, self._last_tokens)
        self._share_samples(pending)
        self._last_tokens, self._last_targets = pending.tokens, targets
        return LaunchedStep(targets, pending, pending_plp, verify, draft_s)

    def _media_inputs(self, step: StepDescription, metas) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's image rows and their encodings, in ``_prepare``'s row order; with a model
        whose image tokens attend both ways, each prefill chunk's image spans go into its
        attention metadata."""
        order = sorted(step.seqs, key=lambda s: s.num_new_tokens != 1)  # _prepare's row order
        enc = self._encodings(step, [m for s in order for m in s.media])
        rows, values, spans = [], [], []
        t = 0
        for s in order:
            end = s.start + s.num_new_tokens
            for m in s.media:
                lo, hi = max(m.offset, s.start), min(m.end, end)
                rows.extend(range(t + lo - s.start, t + hi - s.start))
                values.append(enc[m.key][lo - m.offset: hi - m.offset])
            if s.num_new_tokens != 1:
                spans.append([(m.offset, m.end) for m in s.media])
            t += s.num_new_tokens
        if getattr(self.model, "BIDIRECTIONAL_MEDIA", False) and any(spans):
            for meta, state in zip(metas, self._is_state):
                if not state:
                    meta.bidirectional = spans
        return torch.tensor(rows, dtype=torch.int64, device=self.device), torch.cat(values)

    def _encodings(self, step: StepDescription, items: list) -> dict[str, torch.Tensor]:
        """Each image's encoding ``[tokens, hidden]``: read from the pool's encoder slots when
        cached (``step.encodings``), else encoded (all of the step's new images in one batch)
        and written to the slots reserved for it."""
        out: dict[str, torch.Tensor] = {}
        todo: dict[str, object] = {}
        c = self.cfg
        shape = (c.vision.tokens_per_image, c.hidden_size)
        nbytes = shape[0] * shape[1] * self.dtype.itemsize
        for m in items:
            cached, slots = step.encodings.get(m.key, (False, []))
            if m.key in out or m.key in todo:
                continue
            if cached:
                out[m.key] = self._slot_bytes(slots).reshape(-1)[:nbytes].view(self.dtype).view(shape)
            elif m.encoded is not None:  # an encoder engine's output
                enc = torch.as_tensor(m.encoded).to(self.device, self.dtype)
                if tuple(enc.shape) != shape:
                    raise RuntimeError(f"image {m.key[:12]}: an encoding of shape {tuple(enc.shape)}, not {shape}")
                out[m.key] = enc
                self.encodings_received += 1
            else:
                if m.data is None:
                    raise RuntimeError(f"image {m.key[:12]}: not cached and sent without its pixels")
                todo[m.key] = m
        fresh = [k for k in out if not step.encodings.get(k, (False, []))[0]]  # received
        if todo:
            encoded = self._encode(list(todo.values()))
            self.encoder_runs += len(todo)
            for i, key in enumerate(todo):
                out[key] = encoded[i]
        for key in fresh + list(todo):  # written to the slots reserved for them
            slots = step.encodings.get(key, (False, []))[1]
            if slots:
                raw = out[key].contiguous().view(-1).view(torch.uint8)
                dst = self._slot_bytes(slots)
                flat = torch.zeros(dst.numel(), dtype=torch.uint8, device=self.device)
                flat[: raw.numel()] = raw
                self._slot_view()[torch.tensor(slots, device=self.device)] = flat.view(dst.shape)
        return out

    def _slot_view(self) -> torch.Tensor:
        """The pool buffer as ``uint8 [slots, encoder_slot_bytes]`` (page-major: slot i is bytes
        ``[i * slot_bytes, (i + 1) * slot_bytes)``)."""
        assert self.kv_buffer is not None and self.encoder_slot_bytes
        return self.kv_buffer.view(-1, self.encoder_slot_bytes)

    def _slot_bytes(self, slots: list[int]) -> torch.Tensor:
        """A copy of ``slots``' bytes, ``[len(slots), slot_bytes]``, in order."""
        return self._slot_view()[torch.tensor(slots, device=self.device)]

    def _encode(self, items: list) -> torch.Tensor:
        """Encode images (``MediaItem.data``: ``[3, S, S]`` float32 pixel arrays) in one batch."""
        pixels = torch.from_numpy(np.stack([m.data for m in items])).to(self.device)
        return self.model.encode_images(pixels)

    def _share_samples(self, pending: PendingSamples) -> None:
        """Tensor parallelism: send rank 0's sampled tokens to the other ranks, whose next step
        may read them on the device (async scheduling). One sampler decides every token, so the
        ranks' inputs never diverge whatever the sampler's randomness."""
        if self.tp is not None:
            assert pending.tokens.dtype == torch.int64
            self.tp.broadcast(pending.tokens)

    @torch.inference_mode()
    def sample_deferred(self, step: LaunchedStep, masked_ids: list[str], words: np.ndarray) -> None:
        """Queue the sampling of a step launched with ``defer_sampling``: the targets
        ``masked_ids`` may only sample the tokens their row of ``words`` allows (int32 ``[len,
        words]``, bit ``t % 32`` of word ``t // 32`` for token ``t``)."""
        if step.deferred is None:
            return
        logits, rows = step.deferred
        step.deferred = None
        where = {rid: i for i, rid in enumerate(step.targets)}
        step.samples = self.sampler.launch(logits, rows, self._last_tokens,
                                           ([where[r] for r in masked_ids], words))
        self._share_samples(step.samples)
        self._last_tokens, self._last_targets = step.samples.tokens, step.targets

    def _launch_prompt_logprobs(self, hidden: torch.Tensor, entries: list[PromptLogprobRows],
                                rows: torch.Tensor, targets: torch.Tensor) -> PendingPromptLogprobs:
        """Score the step's prompt-logprob rows on the device (float32 log_softmax, one gather
        for the prompt tokens, top-k with the largest k asked this step) and queue one copy of
        the results to the host."""
        vocab = self.cfg.vocab_size
        assert vocab < 1 << 24, "token ids travel as float32"
        top = min(max(e.k for e in entries), vocab)
        res = prompt_logprobs(self.model.compute_logits, hidden[rows], targets, top, vocab)
        out = PendingPromptLogprobs(entries, self.sampler._to_host(res), top)
        if res.device.type == "cuda":
            out.ready = torch.cuda.Event()
            out.ready.record()
        return out

    def collect(self, step: LaunchedStep) -> dict[str, SampledToken]:
        """Wait for a launched step's samples: a token for every sampling target (a verified
        one's ``spec_token_ids`` holds all its tokens)."""
        out = {} if step.samples is None else dict(zip(step.targets, self.sampler.collect(step.samples)))
        if step.verify is not None:
            for rid, tokens in step.verify.collect().items():
                out[rid] = SampledToken(tokens[-1], spec_token_ids=tokens)
        return out

    @staticmethod
    def collect_prompt_logprobs(step: LaunchedStep) -> dict[str, tuple[int, list[dict[int, tuple[float, int]]]]]:
        """Wait for a launched step's prompt logprobs: per request id that asked for them and
        had prompt rows in the step, (first prompt position scored, one {token: (logprob, rank)}
        per position). Positions start at 1: the first prompt token has no logprob."""
        return step.prompt_logprobs.collect() if step.prompt_logprobs is not None else {}
