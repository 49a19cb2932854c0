"""A load's staging rows on the device, filled from tier payloads with as few copies as the
payloads' placement allows."""
from __future__ import annotations

import torch

from kvos.worker.host_copies import as_tensor


class StagedRows:
    """``rows``: ``uint8 [n, block_bytes]`` on ``device``, row ``i`` the ``i``-th payload passed
    to ``add``. Rows lie ``row_stride`` bytes apart (each row contiguous), the CPU tier's slot
    stride, so payloads in consecutive slots of one arena chunk (as write-through stores a
    prefix) arrive in one copy of the span they cover, up to ``run_bytes`` at a time; the
    slot headers between them come along into the gaps between rows and are never read. One
    large copy keeps the copy engine at the link's rate, where one copy per 2 MiB block lost
    about 8% on the H100.

    Copies are queued on the current stream (asynchronous DMA from pinned slots); ``issued``
    rows have their copies queued, later ones wait in the open run until ``flush``. Safety: a
    payload must not change until the copies are complete (the caller synchronises before any
    slot can be rewritten), and the rows are read only after that (or behind the copy stream)."""

    def __init__(self, n: int, block_bytes: int, row_stride: int, device: torch.device,
                 run_bytes: int) -> None:
        if row_stride < block_bytes or row_stride % 8:
            row_stride = block_bytes
        self.block_bytes, self.row_stride = block_bytes, row_stride
        self.flat = torch.empty(max(1, n) * row_stride, dtype=torch.uint8, device=device)
        self.rows = self.flat.as_strided((n, block_bytes), (row_stride, 1))
        self.run_blocks = max(1, run_bytes // row_stride)
        self.count = 0
        """Rows added."""
        self.issued = 0
        """Rows whose copies are queued: ``rows[:issued]`` is complete once the stream passes here."""
        self._run: tuple[object, torch.Tensor, int] | None = None  # (chunk owner, chunk tensor, offset of the run's first payload)
        self._chunks: dict[int, tuple[object, torch.Tensor]] = {}

    def add(self, payload: bytes | memoryview) -> None:
        """Stage ``payload`` (``block_bytes`` long) as the next row."""
        owner = payload.obj if isinstance(payload, memoryview) and not payload.readonly else None
        if owner is not None:  # a CPU-tier slot: the open run takes it when it is the next slot
            addr = as_tensor(payload).data_ptr()
            run = self._run
            if run is not None and run[0] is owner and self.count - self.issued < self.run_blocks \
                    and addr == run[1].data_ptr() + run[2] + (self.count - self.issued) * self.row_stride:
                self.count += 1
                return
            self.flush()
            chunk = self._chunks.get(id(owner))
            if chunk is None or chunk[0] is not owner:
                chunk = self._chunks[id(owner)] = (owner, torch.frombuffer(owner, dtype=torch.uint8))
            self._run = (owner, chunk[1], addr - chunk[1].data_ptr())
            self.count += 1
            return
        self.flush()
        self.rows[self.count].copy_(as_tensor(payload), non_blocking=True)
        self.count += 1
        self.issued = self.count

    def flush(self) -> None:
        """Queue the open run's copy."""
        if self._run is None:
            return
        _, chunk, offset = self._run
        span = (self.count - self.issued - 1) * self.row_stride + self.block_bytes
        start = self.issued * self.row_stride
        self.flat[start: start + span].copy_(chunk[offset: offset + span], non_blocking=True)
        self._run = None
        self.issued = self.count
