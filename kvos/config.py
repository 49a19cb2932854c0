"""The engine's one configuration object."""
from __future__ import annotations

from dataclasses import dataclass

KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "int8")


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

    model: str | None = None
    block_size: int = 16
    kv_layout: str = "unified"  # hybrid models: "unified" (Jenga pages), "equal_pages" (vLLM), "homogeneous"
    enable_prefix_caching: bool = True
    kv_cache_memory_bytes: int | None = None
    num_blocks: int | None = None
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int | None = None
    dtype: str | None = None  # bfloat16 on a GPU, float32 on the CPU
    kv_cache_dtype: str = "auto"  # the model's dtype; or "fp8_e4m3" / "int8", with scales per token and head
    device: str = "cpu"
    scheduling_policy: str = "fcfs"
    seed: int = 0
    cpu_cache_gb: float = 0.0
    disk_cache_dir: str | None = None
    disk_cache_gb: float = 10.0
    remote_cache: str | None = None  # redis://host:port
    write_policy: str = "write_through"  # or "write_back"
    preemption_mode: str = "recompute"  # or "swap": preempted KV waits in host memory
    swap_space_gb: float = 4.0
    random_weights: bool = False
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    async_scheduling: bool | None = None  # default: on for a CUDA device

    def __post_init__(self) -> None:
        if self.kv_cache_memory_bytes is not None and (not isinstance(self.kv_cache_memory_bytes, int)
                                                       or self.kv_cache_memory_bytes < 1):
            raise ValueError(f"kv_cache_memory_bytes must be a positive integer, got {self.kv_cache_memory_bytes!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_blocks is not None and (not isinstance(self.num_blocks, int) or self.num_blocks < 2):
            raise ValueError(f"num_blocks must be an integer >= 2, got {self.num_blocks!r}")
        if self.kv_layout not in ("unified", "equal_pages", "homogeneous"):
            raise ValueError(f"kv_layout must be 'unified', 'equal_pages' or 'homogeneous', got {self.kv_layout!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ValueError(f"max_model_len must be an integer >= 2, got {self.max_model_len!r}")
