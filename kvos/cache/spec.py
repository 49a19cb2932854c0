"""What one layer group's cache looks like in memory (page geometry and bytes)."""
from __future__ import annotations

from dataclasses import dataclass

DTYPE_BYTES = {"float32": 4, "fp32": 4, "float16": 2, "fp16": 2, "bfloat16": 2, "bf16": 2,
               "fp8": 1, "float8_e4m3fn": 1, "int8": 1}


@dataclass(frozen=True)
class FullAttentionSpec:
    """A group of full-attention layers sharing one block table per request.

    ``page_bytes`` is the size of one block across all layers of the group, K and V together.
    """

    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"unknown KV dtype {self.dtype!r}; known: {sorted(DTYPE_BYTES)}")

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    @property
    def page_bytes(self) -> int:
        return self.block_size * self.bytes_per_token

    def num_blocks_for_memory(self, memory_bytes: int) -> int:
        """Blocks that fit in ``memory_bytes`` (the null block included)."""
        return memory_bytes // self.page_bytes
