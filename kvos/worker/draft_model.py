"""Speculative drafts from a model on the device: a separate draft model whose KV is a cache
group of its own in the pool, or the target's first layers (LayerSkip's early exit), which share
the target's KV."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from kvos.core.step import StepDescription
from kvos.models.attention import AttentionBackend, AttentionMetadata, KVCache
from kvos.models.config import ModelConfig
from kvos.worker.cuda_graphs import DecodeGraphs
from kvos.worker.host_copies import to_device


@dataclass
class DraftModel:
    """Proposes ``k`` tokens per sequence greedily (argmax; rejection sampling then treats the
    proposal as certain, which keeps the target's distribution at any temperature).

    KV invariant (``owns_kv``): the draft's group holds the draft's K/V for every token the
    target has computed, because ``fill_kv`` runs the draft over every row of every target step
    (prefill chunks, decodes, verify rows); so a block registered in the prefix index, saved to
    a tier or swapped holds valid K/V in every group. ``propose`` writes the K/V of the drafts it
    feeds at the verify step's positions, which the verify step's own ``fill_kv`` then rewrites
    with the same tokens. A self-draft (``owns_kv`` False) writes the target's first layers' K/V
    at those positions, which the verify step rewrites for the same reason.

    Safety rule: only the slots of a step that the scheduler allocated are written (``propose``
    reads positions ``start .. start + k - 1`` of a verify sequence of ``k`` drafts, inside the
    ``k + 1`` slots the step holds).
    """

    model: nn.Module
    cfg: ModelConfig
    num_layers: int | None
    """Layers run (the self-draft's early exit); None: all of the draft model's."""
    owns_kv: bool
    kv_layers: list[KVCache] = field(default_factory=list)
    layer_group: list[int] = field(default_factory=list)
    """Per draft layer: its K/V views and its cache group (set by ``bind``)."""
    seconds: float = 0.0
    """Wall time spent proposing (a device sync included)."""
    graphs: DecodeGraphs | None = None
    """The draft's decode steps as CUDA graphs (``capture_graphs``); None: eager."""

    def bind(self, kv_layers: list[KVCache], layer_group: list[int]) -> None:
        self.kv_layers, self.layer_group = kv_layers, layer_group

    def forward(self, input_ids, positions, kv_layers, metas, backend) -> torch.Tensor:
        """The draft's hidden states (the ``DecodeGraphs`` model signature)."""
        return self.model(input_ids, positions, kv_layers, metas, backend, self.num_layers)

    def capture_graphs(self, num_groups: int, backend: AttentionBackend, block_size: int, max_batch: int,
                       max_blocks: int) -> None:
        """Capture the draft's decode steps (its proposals; with K/V of its own, its pass over a
        decode-only target step too) at the target's batch ladder."""
        self.graphs = DecodeGraphs(self.forward, self.kv_layers, self.layer_group, num_groups, backend, block_size,
                                   max_batch, max_blocks)

    def fill_kv(self, input_ids: torch.Tensor, positions: torch.Tensor, metas: list[AttentionMetadata],
                backend: AttentionBackend, slots: torch.Tensor, tables: torch.Tensor) -> None:
        """Write the draft's K/V for a target step's tokens (``metas``, ``slots`` ``[groups, T]``
        and ``tables`` ``[groups, n, width]``: the step's); in the CUDA graphs when the step is
        decode-only and fits them; nothing when the draft shares the target's K/V."""
        if not self.owns_kv:
            return
        meta = metas[0]
        if (self.graphs is not None and meta.num_decodes == len(meta.query_lens_list)
                and self.graphs.can_run(meta.num_decodes, tables.shape[2])):
            self.graphs.run(input_ids, positions, slots, tables, meta.seq_lens)
        else:
            self.forward(input_ids, positions, self.kv_layers, [metas[g] for g in self.layer_group], backend)

    @torch.inference_mode()
    def propose(self, step: StepDescription, block_size: int, backend: AttentionBackend,
                device: torch.device) -> None:
        """Replace the placeholder drafts of ``step``'s verify sequences (their
        ``draft_token_ids`` and the same tail of ``token_ids``) by the draft's tokens: ``k``
        single-token forward passes from each sequence's last known token."""
        seqs = [s for s in step.seqs if s.draft_token_ids]
        if not seqs:
            return
        t0 = time.perf_counter()
        n, bs = len(seqs), block_size
        ks = np.fromiter((len(s.draft_token_ids) for s in seqs), np.int64, n)
        starts = np.fromiter((s.start for s in seqs), np.int64, n)
        num_groups = len(seqs[0].block_ids)
        groups = sorted(set(self.layer_group))
        width = max(len(s.block_ids[groups[0]]) for s in seqs)
        tables = np.zeros((num_groups, n, width), np.int32)
        for i, s in enumerate(seqs):
            for g in groups:
                tables[g, i, : len(s.block_ids[g])] = s.block_ids[g]
        tables_all = to_device(tables, torch.int32, device)
        cur = to_device([s.token_ids[0] for s in seqs], torch.long, device)
        out = torch.zeros(n, int(ks.max()), dtype=torch.long, device=device)
        graphs = self.graphs if self.graphs is not None and self.graphs.can_run(n, width) else None
        for j in range(int(ks.max())):
            rows = np.flatnonzero(ks > j)
            whole = len(rows) == n
            pos = starts[rows] + j
            idx = None if whole else to_device(rows, torch.long, device)
            slots = tables[:, rows, pos // bs].astype(np.int64) * bs + pos % bs
            packed = to_device(np.concatenate([pos, pos + 1, slots.reshape(-1)]), torch.int64, device)
            m = len(rows)
            pos_t, lens_t = packed[:m], packed[m: 2 * m].to(torch.int32)
            slots_t = packed[2 * m:].view(num_groups, m)
            tables_t = tables_all if whole else tables_all[:, idx]
            ids = cur if whole else cur[idx]
            if graphs is not None:
                hidden = graphs.run(ids, pos_t, slots_t, tables_t, lens_t)
            else:
                seq_lens = (pos + 1).tolist()
                metas = {g: AttentionMetadata(
                    slot_mapping=slots_t[g], block_tables=tables_t[g], seq_lens=lens_t, query_lens_list=[1] * m,
                    seq_lens_list=seq_lens, num_decodes=m, block_size=bs,
                    prefill_start_loc=torch.zeros(1, dtype=torch.int32, device=device)) for g in groups}
                hidden = self.forward(ids, pos_t, self.kv_layers, [metas[g] for g in self.layer_group], backend)
            tok = self.model.compute_logits(hidden).argmax(-1)
            if whole:
                cur, out[:, j] = tok, tok
            else:
                cur[idx], out[idx, j] = tok, tok
        drafts = out.tolist()
        for i, s in enumerate(seqs):
            k = int(ks[i])
            s.draft_token_ids[:] = drafts[i][:k]
            s.token_ids[len(s.token_ids) - k:] = drafts[i][:k]
        self.seconds += time.perf_counter() - t0
