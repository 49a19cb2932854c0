"""A 64-bit digest of block rows computed where the rows are (on the GPU: at HBM speed), so the
CPU tier can check a load after copying it instead of hashing it on host threads first."""
from __future__ import annotations

import torch

from kvos.worker.host_copies import as_words, to_device

_MULTIPLIERS: dict[tuple[int, str], torch.Tensor] = {}
CHUNK_BYTES = 64 << 20
"""Rows digested per launch: the product's temporary is at most this large."""


def _multipliers(words: int, device: torch.device) -> torch.Tensor:
    """``words`` odd int64 multipliers, the same on every device and run (a fixed seed)."""
    key = (words, str(device))
    m = _MULTIPLIERS.get(key)
    if m is None:
        gen = torch.Generator().manual_seed(0x6B766F73)  # "kvos"
        m = torch.randint(-(1 << 62), 1 << 62, (words,), dtype=torch.int64, generator=gen) | 1
        m = _MULTIPLIERS[key] = m.to(device)
    return m


def block_digests(rows: torch.Tensor) -> torch.Tensor:
    """int64 ``[n]``: per row of ``rows`` (``uint8 [n, block_bytes]``, contiguous rows, block bytes a
    multiple of 8), the sum over its 64-bit words of word × a fixed odd multiplier of that
    position, modulo 2**64 (int64 products and sums wrap).

    Equal on CPU and GPU for equal bytes. Any change confined to one word changes the digest
    (an odd multiplier is invertible modulo 2**64), as does moving a word to another position;
    other corruption goes unnoticed with probability about 2**-64. It detects torn, zeroed, stale
    or misplaced blocks; it is not a defence against anyone who can write the memory (the CPU
    tier is the engine's own process memory). Queued on the current stream; no host sync."""
    n, bb = rows.shape
    if bb % 8:
        raise ValueError(f"block rows of {bb} bytes are not whole 64-bit words")
    words = rows.view(torch.int64)
    m = _multipliers(bb // 8, rows.device)
    out = torch.empty(n, dtype=torch.int64, device=rows.device)
    step = max(1, CHUNK_BYTES // bb)
    for i in range(0, n, step):
        torch.sum(words[i: i + step] * m, dim=1, out=out[i: i + step])
    return out


def page_digests(pages: torch.Tensor, block_ids: list[int]) -> torch.Tensor:
    """``block_digests`` of rows ``block_ids`` of ``pages`` (``uint8 [num_blocks, block_bytes]``),
    gathered ``CHUNK_BYTES`` at a time. Queued on the current stream."""
    n, bb = len(block_ids), pages.shape[1]
    idx = to_device(block_ids, torch.long, pages.device)
    out = torch.empty(n, dtype=torch.int64, device=pages.device)
    step = max(1, CHUNK_BYTES // bb)
    words = as_words(pages)
    for i in range(0, n, step):
        out[i: i + step] = block_digests(words[idx[i: i + step]].view(torch.uint8))
    return out
