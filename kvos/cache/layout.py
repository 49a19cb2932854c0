"""How a model's layers map onto cache groups and one physical pool of pages. Pure Python.

Three layouts, for the same model, so they can be compared:

- ``unified`` (Jenga): one group per kind of layer (full attention; each sliding window); one
  pool of *large pages* of ``lcm(group page bytes)``, each split on demand into small pages of
  one group and returned whole when all of them are free.
- ``equal_pages`` (vLLM's hybrid allocator): groups of equal layer count (the smallest group's;
  a larger kind is split into several groups, the last padded with empty layer slots), so every
  page has the same size and one free list serves all groups.
- ``homogeneous``: one full-attention group of every layer; sliding layers still attend within
  their window but keep every token's KV (what an engine without hybrid support does).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from kvos.cache.spec import (
    CacheSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaStateSpec,
    SlidingWindowSpec,
)

LAYOUTS = ("unified", "equal_pages", "homogeneous")


@dataclass(frozen=True)
class CacheGroup:
    """Layers ``layers`` share one block table per request; slot i of a page holds
    ``layers[i]`` (slots past ``len(layers)`` are padding). ``role`` says whose layers they
    are: the served model's, or a speculative draft model's (numbered after the target's)."""

    spec: CacheSpec
    layers: tuple[int, ...]
    role: str = "model"

    @property
    def padding_layers(self) -> int:
        return self.spec.num_layers - len(self.layers)


@dataclass(frozen=True)
class CacheLayout:
    groups: tuple[CacheGroup, ...]
    mode: str = "unified"
    layer_windows: tuple[int | None, ...] = ()
    """Each model layer's attention window (None: full, or a Mamba layer): what its KV must
    really hold."""

    def __post_init__(self) -> None:
        if self.mode not in LAYOUTS:
            raise ValueError(f"kv_layout must be one of {LAYOUTS}, got {self.mode!r}")
        if not self.groups:
            raise ValueError("a cache layout needs at least one group")
        if len({g.spec.block_size for g in self.groups}) != 1:
            raise ValueError("every cache group must use the same block size")

    @property
    def block_size(self) -> int:
        return self.groups[0].spec.block_size

    @property
    def large_page_bytes(self) -> int:
        return math.lcm(*(g.spec.page_bytes for g in self.groups))

    def blocks_per_large_page(self, group: int) -> int:
        return self.large_page_bytes // self.groups[group].spec.page_bytes

    def layer_slot(self, layer: int) -> tuple[int, int]:
        """(group, slot in the group's page) of a model layer."""
        for g, group in enumerate(self.groups):
            if layer in group.layers:
                return g, group.layers.index(layer)
        raise KeyError(f"layer {layer} is in no cache group")

    @property
    def num_layers(self) -> int:
        return sum(len(g.layers) for g in self.groups)

    def live_bytes(self, num_tokens: int) -> int:
        """KV bytes a request of ``num_tokens`` tokens really needs, whatever the layout: every
        token in full-attention layers, the ``window - 1`` that its next token reads in sliding
        layers. The floor that waste is measured against."""
        total = 0
        for g in self.groups:
            if isinstance(g.spec, MambaStateSpec):
                total += g.spec.page_bytes if num_tokens else 0  # one state, whatever the length
                continue
            per_layer = g.spec.bytes_per_token // g.spec.num_layers
            total += sum(per_layer * (num_tokens if w is None else min(num_tokens, w - 1))
                         for w in (self.layer_windows[layer] for layer in g.layers))
        return total

    def num_pages_for_memory(self, memory_bytes: int) -> int:
        """Large pages that fit in ``memory_bytes`` (the null page included)."""
        return memory_bytes // self.large_page_bytes

    def describe(self) -> list[dict]:
        return [{"kind": g.spec.kind, "role": g.role, "window": getattr(g.spec, "window", None), "layers": list(g.layers),
                 "padding_layers": g.padding_layers, "page_bytes": g.spec.page_bytes,
                 "bytes_per_token": g.spec.bytes_per_token,
                 "blocks_per_large_page": self.blocks_per_large_page(i)} for i, g in enumerate(self.groups)]


def _spec(window: int | None, block_size: int, layers: int, kv_heads: int, head_dim: int,
          dtype: str) -> KVCacheSpec:
    if window is None:
        return FullAttentionSpec(block_size, layers, kv_heads, head_dim, dtype)
    return SlidingWindowSpec(block_size, layers, kv_heads, head_dim, dtype, window=window)


def build_layout(layer_windows: list[int | None], block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: str = "float32", mode: str = "unified",
                 state: MambaStateSpec | None = None, state_layers: tuple[int, ...] = ()) -> CacheLayout:
    """Group a model's layers by attention window (``None``: full attention) in ``mode``; the
    layers ``state_layers`` (Mamba) form one more group of ``state`` pages, after the attention
    groups, in the same pool."""
    if mode not in LAYOUTS:
        raise ValueError(f"kv_layout must be one of {LAYOUTS}, got {mode!r}")
    if state_layers:
        assert state is not None and state.num_layers == len(state_layers)
        if mode == "equal_pages":
            raise ValueError("kv_layout='equal_pages' cannot hold Mamba state pages (their size is not a KV "
                             "page's); use 'unified' or 'homogeneous'")
        attn = [i for i in range(len(layer_windows)) if i not in set(state_layers)]
        if not attn:
            groups: tuple[CacheGroup, ...] = ()
        else:
            inner = build_layout([layer_windows[i] for i in attn], block_size, num_kv_heads, head_dim, dtype, mode)
            groups = tuple(CacheGroup(g.spec, tuple(attn[i] for i in g.layers), g.role) for g in inner.groups)
            state = replace(state, page_align=math.lcm(*(g.spec.page_bytes for g in groups)))
        return CacheLayout((*groups, CacheGroup(state, tuple(state_layers))), mode, tuple(layer_windows))
    windows = tuple(layer_windows)
    if mode == "homogeneous" or all(w is None for w in windows):
        spec = FullAttentionSpec(block_size, len(windows), num_kv_heads, head_dim, dtype)
        return CacheLayout((CacheGroup(spec, tuple(range(len(windows)))),), mode, windows)
    by_window: dict[int | None, list[int]] = {}
    for layer, w in enumerate(windows):
        by_window.setdefault(w, []).append(layer)
    kinds = sorted(by_window.items(), key=lambda kv: (kv[0] is not None, kv[0] or 0))  # full first
    groups: list[CacheGroup] = []
    if mode == "unified":
        for w, layers in kinds:
            groups.append(CacheGroup(_spec(w, block_size, len(layers), num_kv_heads, head_dim, dtype), tuple(layers)))
    else:  # equal_pages
        size = min(len(layers) for _, layers in kinds)
        for w, layers in kinds:
            for i in range(0, len(layers), size):
                groups.append(CacheGroup(_spec(w, block_size, size, num_kv_heads, head_dim, dtype),
                                         tuple(layers[i: i + size])))
    return CacheLayout(tuple(groups), mode, windows)


def single_group_layout(spec: KVCacheSpec) -> CacheLayout:
    """A layout of one group (tests, the simulator's abstract model)."""
    window = getattr(spec, "window", None)
    return CacheLayout((CacheGroup(spec, tuple(range(spec.num_layers))),), "unified",
                       tuple([window] * spec.num_layers))


def with_draft_group(layout: CacheLayout, num_layers: int, num_kv_heads: int, head_dim: int,
                     dtype: str) -> CacheLayout:
    """``layout`` plus one full-attention group for a speculative draft model's ``num_layers``
    layers (numbered after the target's), in the same pool: its own page size, blocks and prefix
    index, allocated, cached, swapped and freed with its request's other groups."""
    first = len(layout.layer_windows)
    spec = FullAttentionSpec(layout.block_size, num_layers, num_kv_heads, head_dim, dtype)
    group = CacheGroup(spec, tuple(range(first, first + num_layers)), role="draft")
    return CacheLayout((*layout.groups, group), layout.mode, (*layout.layer_windows, *([None] * num_layers)))
