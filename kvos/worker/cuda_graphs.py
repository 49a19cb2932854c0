"""Whole decode steps captured as CUDA graphs at a ladder of batch sizes."""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

import torch

from kvos.models.attention import AttentionBackend, AttentionMetadata
from kvos.models.state import graph_state_metadata

T = TypeVar("T")


def warm_up(device: torch.device, run: Callable[[], object], times: int = 2) -> None:
    """Run ``run`` ``times`` on a side stream before a capture: kernel compilation and the
    allocator's first blocks stay out of the graph."""
    stream = torch.cuda.Stream(device=device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(times):
            run()
    torch.cuda.current_stream(device).wait_stream(stream)


def capture(run: Callable[[], T], pool: object | None) -> tuple[torch.cuda.CUDAGraph, T]:
    """``run`` captured as one graph in memory pool ``pool`` (None: a new pool, then
    ``graph.pool()`` for the next captures to share); returns the graph and ``run``'s output,
    whose tensors each replay overwrites."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = run()
    return graph, out


def upload(graphs: Iterable[torch.cuda.CUDAGraph], device: torch.device) -> None:
    """Replay each graph once (the first replay uploads it; done at start-up, not mid-run).
    Only safe when the graphs' inputs are padding that writes nothing to the cache."""
    for graph in graphs:
        graph.replay()
    torch.cuda.synchronize(device)


def batch_ladder(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to ``max_batch`` (which is always included)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16)) + [max_batch]
    return sorted(set(sizes))


class DecodeGraphs:
    """The model's forward pass (embeddings to final norm) for ``b`` decode tokens, one per
    sequence, replayed from static input buffers (a slot mapping and block tables per cache
    group).

    A step of ``n`` sequences runs the smallest captured batch ``b >= n``; rows ``n..b`` are
    padding: their slot is -1 (nothing is written to the cache), they read block 0 and their
    outputs are dropped. Steps with a sequence longer than ``max_blocks`` blocks, or more than
    the largest batch, run eagerly.

    Safety rules: the KV pool and the model must outlive the graphs (replays use their
    addresses); the hidden states returned by ``run`` are overwritten by the next replay.
    """

    def __init__(self, model: torch.nn.Module, kv_layers: list, layer_group: list[int],
                 num_groups: int, backend: AttentionBackend, block_size: int, max_batch: int,
                 max_blocks: int, state_groups: frozenset[int] = frozenset()) -> None:
        """``state_groups``: the cache groups of Mamba state, whose reads and writes the graph
        derives from their tables (``graph_state_metadata``)."""
        dev = next(kv_layers[i] for i, g in enumerate(layer_group) if g not in state_groups).k.device
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.sizes = batch_ladder(max_batch)
        self.max_batch = self.sizes[-1]
        b = self.max_batch
        self.input_ids = torch.zeros(b, dtype=torch.long, device=dev)
        self.positions = torch.zeros(b, dtype=torch.long, device=dev)
        self.slots = torch.full((num_groups, b), -1, dtype=torch.long, device=dev)
        self.tables = torch.zeros(num_groups, b, max_blocks, dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(b, dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        pool = None
        for size in reversed(self.sizes):  # largest first: smaller graphs reuse its memory pool
            metas = [AttentionMetadata(slot_mapping=self.slots[g, :size], block_tables=self.tables[g, :size],
                                       seq_lens=self.seq_lens[:size], query_lens_list=[], seq_lens_list=[],
                                       num_decodes=size, block_size=block_size) for g in range(num_groups)]

            def step(size=size, metas=metas):
                for g in state_groups:  # inside the graph: recomputed from the static buffers at each replay
                    metas[g] = graph_state_metadata(self.tables[g, :size], self.seq_lens[:size],
                                                    self.slots[g, :size], block_size)
                layer_metas = [metas[g] for g in layer_group]
                return model(self.input_ids[:size], self.positions[:size], kv_layers, layer_metas, backend)

            warm_up(dev, step)
            self.graphs[size], self.outputs[size] = capture(step, pool)
            pool = self.graphs[size].pool()
        upload(self.graphs.values(), dev)  # all rows are padding: nothing is written to the cache

    def can_run(self, num_seqs: int, max_blocks: int) -> bool:
        return num_seqs <= self.max_batch and max_blocks <= self.max_blocks

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
            tables: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """Hidden states ``[n, hidden]`` of n decode tokens (inputs on the device; ``slots``
        ``[groups, n]``, ``tables`` ``[groups, n, width]``)."""
        _, n, width = tables.shape
        size = next(s for s in self.sizes if s >= n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slots[:, :n].copy_(slots)
        self.slots[:, n:size].fill_(-1)
        self.tables[:, :n, :width].copy_(tables)
        self.seq_lens[:n].copy_(seq_lens)
        self.seq_lens[n:size].fill_(1)
        self.graphs[size].replay()
        return self.outputs[size][:n]
