"""GPU presets and dtype sizes for the planner and the simulator's cost model."""
from __future__ import annotations

from dataclasses import dataclass

from kvos.cache.spec import FullAttentionSpec

GIB = 1 << 30


@dataclass(frozen=True)
class GPU:
    """Memory in bytes, HBM bandwidth in bytes/s, dense bf16/fp16 peak in FLOP/s."""

    name: str
    memory_bytes: int
    bandwidth: float
    flops: float


GPUS = {g.name: g for g in [
    GPU("A100-80G", 80 * GIB, 2.039e12, 312e12),
    GPU("H100-80G", 80 * GIB, 3.35e12, 989e12),
    GPU("H200", 141 * 10**9, 4.8e12, 989e12),
    GPU("L4", 24 * GIB, 0.3e12, 121e12),
]}

WEIGHT_BYTES = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5}
KV_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3",
             "int8": "int8"}
"""The planner's KV dtype names and the cache's (``kvos.cache.spec.DTYPE_BYTES``) for each."""


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, kv_dtype: str) -> int:
    """K and V of one token over ``num_layers`` layers: the cache's own formula
    (``KVCacheSpec.bytes_per_token``), so the planner, the simulator and the engine agree."""
    return FullAttentionSpec(1, num_layers, num_kv_heads, head_dim, KV_DTYPES.get(kv_dtype, kv_dtype)).bytes_per_token


def resolve_gpu(name: str | None, memory_gib: float | None = None, bandwidth_tbs: float | None = None,
                tflops: float | None = None) -> GPU:
    """A preset (case-insensitive), optionally overridden by explicit figures."""
    base = GPUS["H100-80G"] if name is None else next((g for k, g in GPUS.items() if k.lower() == name.lower()), None)
    if base is None:
        raise ValueError(f"gpu: unknown preset {name!r}; known: {', '.join(GPUS)} (or give --gpu-memory-gib, "
                         f"--gpu-bandwidth-tbs, --gpu-tflops)")
    return GPU(base.name if memory_gib is None else f"custom({memory_gib} GiB)",
               int(memory_gib * GIB) if memory_gib is not None else base.memory_bytes,
               bandwidth_tbs * 1e12 if bandwidth_tbs is not None else base.bandwidth,
               tflops * 1e12 if tflops is not None else base.flops)
