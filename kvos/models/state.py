"""Recurrent state as the Mamba layers read it: one layer's paged states and a step's state metadata."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


class StateCache(NamedTuple):
    """One Mamba layer's paged states (float32 views into its group's pages): ``conv`` ``[num_blocks,
    conv_dim, conv_width]`` (the last ``conv_width`` inputs of the causal convolution, oldest
    first) and ``ssm`` ``[num_blocks, heads, head_dim, state_size]``. Block 0 is the null block:
    never read, and writes to it are dropped."""

    conv: torch.Tensor
    ssm: torch.Tensor


@dataclass
class SeqStates:
    """Where one sequence of a step reads and writes its state.

    Rows ``[row, row + num_tokens)`` of the step are its new tokens. ``read_block``: the block
    holding the state after its computed tokens (-1: none yet, start from zeros). ``saves``:
    (number of the sequence's new tokens, block): after that many tokens, write the state into
    the block; the last entry is always ``(num_tokens, block of the last token)``.
    """

    row: int
    num_tokens: int
    read_block: int
    saves: list[tuple[int, int]]


@dataclass
class StateMetadata:
    """A step's sequences in row order (decodes first), for every Mamba layer of one group.

    Safety rule: every block named is referenced by its sequence for the whole step, and no two
    sequences of a step write the same block (the state manager's copy-on-write guarantees it)."""

    seqs: list[SeqStates]
    num_decodes: int
    _decode_index: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None
    _prefill_chunks: object | None = None
    _prefill_conv_rows: object | None = None

    def prefill_chunks(self, device: torch.device):
        """The prefills' chunk table for ``kvos.kernels.mamba_scan`` (rows counted from the first
        prefill row), built once per step and shared by the layers."""
        if self._prefill_chunks is None:
            from kvos.kernels.mamba_scan import scan_chunks

            self._prefill_chunks = scan_chunks(self.seqs[self.num_decodes:], self.num_decodes, device)
        return self._prefill_chunks

    def prefill_conv_rows(self, device: torch.device):
        """The prefills' convolution table for ``kvos.kernels.mamba_scan.conv_prefill``, built once
        per step and shared by the layers."""
        if self._prefill_conv_rows is None:
            from kvos.kernels.mamba_scan import conv_rows

            self._prefill_conv_rows = conv_rows(self.seqs[self.num_decodes:], self.num_decodes, device)
        return self._prefill_conv_rows

    def decode_index(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                          torch.Tensor | None]:
        """The decodes' (blocks read, clamped at 0; 1.0 where a state was read, 0.0 where the
        decode starts from zeros, ``[n, 1, 1]``; blocks written; None, or a bool ``[n]`` that is
        False for padding rows, which write nothing), on ``device``: built once per step,
        shared by the layers."""
        if self._decode_index is None:
            dec = self.seqs[: self.num_decodes]
            idx = torch.tensor([[max(q.read_block, 0) for q in dec], [q.read_block >= 0 for q in dec],
                                [q.saves[-1][1] for q in dec]], dtype=torch.int64).to(device, non_blocking=True)
            self._decode_index = (idx[0], idx[1].float().view(-1, 1, 1), idx[2], None)
        return self._decode_index


def graph_state_metadata(tables: torch.Tensor, seq_lens: torch.Tensor, slots: torch.Tensor,
                         block_size: int) -> StateMetadata:
    """A decode batch's state reads and writes computed on the device from its state-group block
    tables ``[n, width]``, lengths after the step (``seq_lens``) and slots (-1: a padding row):
    torch operations only, so that a CUDA graph captures them. The same rule as
    ``state_metadata`` for one-token steps."""
    start = seq_lens.long() - 1
    valid = slots >= 0
    reads = tables.gather(1, ((start - 1).clamp(min=0) // block_size)[:, None]).squeeze(1).long()
    reads = torch.where(valid, reads, 0)  # a padding row reads block 0 and writes it back unchanged
    writes = tables.gather(1, (start // block_size)[:, None]).squeeze(1).long()
    keep = ((start > 0) & valid).float().view(-1, 1, 1)
    meta = StateMetadata([], tables.shape[0])
    meta._decode_index = (reads, keep, writes, valid)
    return meta


def state_metadata(block_size: int, starts: list[int], num_tokens: list[int], tables: list[list[int]],
                   num_decodes: int) -> StateMetadata:
    """The reads and writes the state tables call for (``MambaStateManager``): read the block
    of token ``start - 1``; write the state at each block boundary crossed into that block when
    it is not null, and the final state into the block of the last token."""
    seqs, row = [], 0
    for start, n, table in zip(starts, num_tokens, tables):
        read = table[(start - 1) // block_size] if start else -1
        assert read != 0, "the state after a sequence's computed tokens is in the null block"
        end = start + n
        saves = []
        for b in range(start // block_size, (end - 1) // block_size):
            boundary = (b + 1) * block_size  # start < boundary < end
            if table[b] != 0:
                saves.append((boundary - start, table[b]))
        saves.append((n, table[(end - 1) // block_size]))
        seqs.append(SeqStates(row, n, read, saves))
        row += n
    return StateMetadata(seqs, num_decodes)
