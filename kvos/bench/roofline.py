"""The two ceilings of a GPU (memory bandwidth, bf16 matrix rate) and the roofline time of a
model step from them."""
from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


def cycling(fn, items: list):
    """A callable that calls ``fn`` on the next of ``items`` each time, round robin: a weight per
    call in a timed graph, each out of L2 when ``items`` hold more bytes than the cache."""
    state = {"i": 0}

    def call():
        fn(items[state["i"] % len(items)])
        state["i"] += 1
    return call


def cuda_median_ms(fn, reps: int = 20, warmup: int = 3) -> float:
    """Median milliseconds of ``fn()`` (the upper one for even ``reps``) over ``reps`` calls
    after ``warmup`` untimed ones, each between two CUDA events on the current stream."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def cuda_graph_ms(fn, calls: int = 32, reps: int = 20) -> float:
    """Median milliseconds per call of ``fn`` on the GPU alone: ``calls`` calls captured in one
    CUDA graph (after one warm-up call on a side stream, which also compiles), replayed ``reps``
    times between CUDA events. ``fn`` must be capturable (no host synchronisation)."""
    import torch

    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / calls)
    return sorted(times)[len(times) // 2]


def measure_ceilings(device: str = "cuda") -> dict:
    """Device-to-device copy bandwidth (bytes read + written) and an 8192^3 bf16 matrix product,
    each the median of 20 timed runs after warm-up, on random data."""
    import torch

    n = 1 << 30
    buffers = [torch.randint(0, 255, (n,), dtype=torch.uint8, device=device), torch.empty(n, dtype=torch.uint8,
                                                                                         device=device)]
    copy_ms = cuda_median_ms(lambda: buffers[1].copy_(buffers[0]))
    buffers.clear()
    m = 8192
    a = torch.randn(m, m, dtype=torch.bfloat16, device=device)
    b = torch.randn(m, m, dtype=torch.bfloat16, device=device)
    gemm_ms = cuda_median_ms(lambda: a @ b)
    return {"hbm_GBps": 2 * n / copy_ms / 1e6, "bf16_gemm_TFLOPs": 2 * m**3 / gemm_ms / 1e9}


def causal_pairs(start: int, end: int, window: int | None) -> int:
    """(query, key) pairs of queries at positions ``start .. end-1``, each seeing ``p + 1`` keys
    or at most ``window``."""
    if window is None:
        window = end
    m = min(max(start, window), end)
    return (m * (m + 1) - start * (start + 1)) // 2 + (end - m) * window


@dataclass
class ModelCost:
    """Bytes and FLOPs of a decoder step: every weight read once per step (the embedding table
    excepted: only its used rows), K/V read once per sequence, 2 FLOPs per weight per token, and
    4 * heads * head_dim FLOPs per (query, key) pair per layer. A sliding-window layer counts
    only the keys inside its window (what it must read)."""

    weight_bytes: int
    matmul_params: int
    kv_bytes_per_token: int  # per token, all layers
    attn_flops_per_pair: int  # per (query, key) pair, all layers
    layer_windows: tuple[int | None, ...] = ()

    def _keys(self, context: int) -> float:
        """Keys read per layer, averaged over layers (context, or the window)."""
        if not self.layer_windows:
            return context
        return sum(context if w is None else min(context, w) for w in self.layer_windows) / len(self.layer_windows)

    @classmethod
    def of(cls, model, dtype_bytes: int, layout=None) -> ModelCost:
        """Weights of ``dtype_bytes``; K/V as the engine's cache ``layout`` stores them (its
        dtype and scales: ``KVCacheSpec.bytes_per_token``), else in the weights' dtype."""
        cfg = model.cfg
        kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype_bytes
        if layout is not None:
            spec = layout.groups[0].spec
            kv_per_token = spec.bytes_per_token // spec.num_layers * cfg.num_layers
        params = {id(p): p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n}
        if cfg.tie_word_embeddings:
            params[id(model.lm_head.weight)] = model.lm_head.weight.numel()
        total = sum(params.values())
        return cls(weight_bytes=total * dtype_bytes, matmul_params=total,
                   kv_bytes_per_token=kv_per_token,
                   attn_flops_per_pair=4 * cfg.num_layers * cfg.num_heads * cfg.head_dim,
                   layer_windows=tuple(cfg.layer_windows()) if any(cfg.layer_windows()) else ())

    def decode_seconds(self, contexts: list[int], ceilings: dict) -> float:
        """Roofline time of a decode step over sequences of these context lengths."""
        keys = sum(map(self._keys, contexts)) if self.layer_windows else sum(contexts)
        kv_read = keys * self.kv_bytes_per_token
        flops = 2 * self.matmul_params * len(contexts) + self.attn_flops_per_pair * keys
        return max((self.weight_bytes + kv_read) / (ceilings["hbm_GBps"] * 1e9),
                   flops / (ceilings["bf16_gemm_TFLOPs"] * 1e12))

    def prefill_flops(self, new_tokens: int, context_after: int) -> float:
        """A chunk of ``new_tokens`` ending at ``context_after`` tokens (causal pairs only)."""
        start = context_after - new_tokens
        windows = self.layer_windows or (None,)
        pairs = sum(causal_pairs(start, context_after, w) for w in windows) / len(windows)
        return 2 * self.matmul_params * new_tokens + self.attn_flops_per_pair * pairs


class StepRecorder:
    """An engine ``schedule_hook`` that adds up the ideal time of the steps actually scheduled:
    prefill FLOPs at the matrix rate, each step's decodes at their roofline. It also splits the
    wall time between steps (hook to hook: each step ends with a device sync in sampling) by
    kind, decode-only or with prefill, against each kind's ideal, and within that the seconds
    the host spent waiting for the device's samples when ``time_device_waits`` wraps the runner
    (the rest of the wall time is host work the device did not hide). With async scheduling a
    step's wait is for the step before it."""

    def __init__(self, cost: ModelCost, ceilings: dict) -> None:
        self.cost, self.ceil = cost, ceilings
        self.prefill_flops = 0.0
        self.decode_seconds = 0.0
        self.steps = 0
        self.by_kind = {k: {"steps": 0, "wall_seconds": 0.0, "device_wait_seconds": 0.0, "ideal_seconds": 0.0}
                        for k in ("decode", "prefill")}
        self._last: tuple[float, str, float] | None = None
        self._wait = 0.0

    def __call__(self, out) -> None:
        now = time.perf_counter()
        self.close(now)
        contexts, flops = [], 0.0
        for s in out.seqs:
            if s.num_new_tokens == 1:
                contexts.append(s.start + 1)
            else:
                flops += self.cost.prefill_flops(s.num_new_tokens, s.start + s.num_new_tokens)
        decode = self.cost.decode_seconds(contexts, self.ceil) if contexts else 0.0
        self.prefill_flops += flops
        self.decode_seconds += decode
        self.steps += not out.is_empty
        if not out.is_empty:
            ideal = flops / (self.ceil["bf16_gemm_TFLOPs"] * 1e12) + decode
            self._last = (now, "prefill" if flops else "decode", ideal)

    def close(self, now: float) -> None:
        """End the step in flight (call once more after the run)."""
        if self._last is not None:
            t, kind, ideal = self._last
            row = self.by_kind[kind]
            row["steps"] += 1
            row["wall_seconds"] += now - t
            row["device_wait_seconds"] += self._wait
            row["ideal_seconds"] += ideal
            self._last = None
        self._wait = 0.0

    @contextmanager
    def time_device_waits(self, runner) -> Iterator[None]:
        """Time each ``runner.collect`` call: the host waiting for the device's results (an
        instance attribute shadows the method while inside; removed on exit)."""
        collect = runner.collect

        def timed(step):
            t = time.perf_counter()
            try:
                return collect(step)
            finally:
                self._wait += time.perf_counter() - t

        runner.collect = timed
        try:
            yield
        finally:
            del runner.collect

    @property
    def ideal_seconds(self) -> float:
        return self.prefill_flops / (self.ceil["bf16_gemm_TFLOPs"] * 1e12) + self.decode_seconds


class TritonCompiles:
    """Counts Triton kernel compilations (and their seconds) while entered. Loading a variant
    from Triton's on-disk cache counts too. A compile inside a timed run is a stall that a
    long-running server pays once."""

    def __init__(self) -> None:
        self.count = 0
        self.seconds = 0.0
        self.kernels: dict[str, int] = {}
        self._t = 0.0

    def _start(self, **_) -> bool:
        self._t = time.perf_counter()
        return False  # False: go on and compile

    def _end(self, *, fn, **_) -> None:
        self.count += 1
        self.seconds += time.perf_counter() - self._t
        self.kernels[fn.name] = self.kernels.get(fn.name, 0) + 1

    def __enter__(self) -> TritonCompiles:
        from triton import knobs

        self._saved = (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook)
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = self._start, self._end
        return self

    def __exit__(self, *exc) -> None:
        from triton import knobs

        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = self._saved

    def as_dict(self) -> dict:
        return {"count": self.count, "seconds": self.seconds, "kernels": self.kernels}
