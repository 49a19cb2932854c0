"""What one layer group's cache looks like in memory (page geometry and bytes)."""
from __future__ import annotations

from dataclasses import dataclass

DTYPE_BYTES = {"float32": 4, "fp32": 4, "float16": 2, "fp16": 2, "bfloat16": 2, "bf16": 2,
               "fp8_e4m3": 1, "int8": 1}

QUANTIZED_KV_DTYPES = ("fp8_e4m3", "int8")
"""KV dtypes stored with a scale per (token, layer, K or V, kv head): ``x ~= q * scale``."""

SCALE_BYTES = 4
"""One float32 scale per (token, layer, K or V, kv head) of a quantized cache."""


@dataclass(frozen=True)
class KVCacheSpec:
    """A group of layers sharing one block table per request.

    ``num_layers`` counts the layer slots of one page (padding included, in the equal-pages
    mode); ``page_bytes`` is one block across all of them, K and V together, scales included.
    ``dtype`` is the KV cache's own dtype: the model's, or a quantized one (``fp8_e4m3``,
    ``int8``) whose scales live in the same page as the data they scale, so every copy of a
    block (copy-on-write, swap, tiers) carries them.
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
    def kind(self) -> str:
        raise NotImplementedError

    @property
    def quantized(self) -> bool:
        return self.dtype in QUANTIZED_KV_DTYPES

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token over the group's layer slots, their scales included: the one
        formula that the engine, the planner, the simulator and the roofline all use."""
        per_head = self.head_dim * DTYPE_BYTES[self.dtype] + (SCALE_BYTES if self.quantized else 0)
        return 2 * self.num_layers * self.num_kv_heads * per_head

    @property
    def data_bytes(self) -> int:
        """Bytes of one page before its scales: ``[layer slots, 2, block_size, kv_heads,
        head_dim]`` elements of ``dtype``; the float32 scales ``[layer slots, 2, kv_heads,
        block_size]`` follow them (quantized dtypes only)."""
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    @property
    def page_bytes(self) -> int:
        return self.block_size * self.bytes_per_token

    def num_blocks_for_memory(self, memory_bytes: int) -> int:
        """Blocks that fit in ``memory_bytes`` (the null block included)."""
        return memory_bytes // self.page_bytes


@dataclass(frozen=True)
class FullAttentionSpec(KVCacheSpec):
    """Layers that attend to every earlier token: a request keeps all its blocks."""

    @property
    def kind(self) -> str:
        return "full_attention"


@dataclass(frozen=True)
class SlidingWindowSpec(KVCacheSpec):
    """Layers whose query at position p attends keys ``p - window < j <= p``: blocks wholly
    before the window of every future token are released while the request runs."""

    window: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.window < 1:
            raise ValueError(f"sliding window must be >= 1, got {self.window}")

    @property
    def kind(self) -> str:
        return "sliding_window"


STATE_DTYPE_BYTES = 4
"""Recurrent state is kept in float32 whatever the model's dtype (the scan accumulates in it)."""


@dataclass(frozen=True)
class MambaStateSpec:
    """A group of Mamba2 layers: per request, each layer's conv state (the last ``conv_width``
    inputs of its causal convolution, ``[conv_dim, conv_width]``) and SSM state (``[heads,
    head_dim, state_size]``), float32. One page holds both states of every layer slot, the state
    *after* some token: its size does not depend on ``block_size`` or on the request's length.

    Block ``i`` of a request's state table holds the state after tokens ``[0, (i + 1) *
    block_size)`` once the request has computed that far (before, the state after its last
    computed token); positions holding no state are the null block. ``cache_every``: within a
    prefill step, the state is also kept at every ``cache_every``-th block boundary (so a later
    request can restore it), besides the step's last block. ``page_align``: the page is padded to
    a multiple of it (the attention groups' page bytes, so that the pool's large page, the least
    common multiple of every group's page, is one state page and not their product).
    """

    block_size: int
    num_layers: int
    conv_dim: int
    conv_width: int
    num_heads: int
    head_dim: int
    state_size: int
    cache_every: int = 1
    page_align: int = 1
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.cache_every < 1:
            raise ValueError(f"mamba_cache_every must be >= 1, got {self.cache_every}")

    @property
    def kind(self) -> str:
        return "mamba_state"

    @property
    def quantized(self) -> bool:
        return False

    @property
    def conv_floats(self) -> int:
        return self.conv_dim * self.conv_width

    @property
    def ssm_floats(self) -> int:
        return self.num_heads * self.head_dim * self.state_size

    @property
    def layer_bytes(self) -> int:
        """One layer slot: its conv state, then its SSM state."""
        return (self.conv_floats + self.ssm_floats) * STATE_DTYPE_BYTES

    @property
    def data_bytes(self) -> int:
        """The states of every layer slot, before the page's padding."""
        return self.num_layers * self.layer_bytes

    @property
    def page_bytes(self) -> int:
        return -(-self.data_bytes // self.page_align) * self.page_align

    @property
    def bytes_per_token(self) -> int:
        """0: a state does not grow with the request (``page_bytes`` per request)."""
        return 0

    def num_blocks_for_memory(self, memory_bytes: int) -> int:
        return memory_bytes // self.page_bytes


MAX_STATE_CACHE_EVERY = 16
"""The longest default ``cache_every`` (256 tokens at 16-token blocks). Simulated on Bamba-9B with
1,500-token system prompts shared by many requests, token hit rates were 81.5% / 70.9% / 56.7% /
48.8% at 4 / 16 / 64 / 1,253 blocks (``benchmarks/results/state_cadence_*.json``): a longer
cadence loses most of a shared prompt; a shorter one writes more pages per prefill chunk."""


def default_cache_every(state_page_bytes: int, kv_block_bytes: int) -> int:
    """The blocks whose KV (``kv_block_bytes`` each, every attention layer) weighs one state
    page (a prefill's checkpoints then hold at most as much memory as its KV), at most
    ``MAX_STATE_CACHE_EVERY``; that for a model without attention layers."""
    if not kv_block_bytes:
        return MAX_STATE_CACHE_EVERY
    return min(MAX_STATE_CACHE_EVERY, -(-state_page_bytes // kv_block_bytes))


CacheSpec = KVCacheSpec | MambaStateSpec
"""What a cache group's pages hold: KV of attention layers, or recurrent state of Mamba layers."""
