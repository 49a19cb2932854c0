"""Host memory for preemption by swap."""
from __future__ import annotations

import torch

GIB = 1 << 30


class HostSwapSpace:
    """Keeps preempted sequences' block bytes in host memory (pinned on a GPU), up to
    ``capacity_bytes``; when full, ``swap_out`` declines and the sequence is recomputed
    instead. Each direction is one batched copy (``read_blocks``/``write_blocks``)."""

    def __init__(self, runner, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"swap_space_gb must be > 0, got {capacity_bytes / GIB}")
        self.runner = runner
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._saved: dict[str, torch.Tensor] = {}

    def swap_out(self, request_id: str, block_ids: list[int]) -> bool:
        size = len(block_ids) * self.runner.block_bytes
        if self.used_bytes + size > self.capacity_bytes:
            return False
        self._saved[request_id] = self.runner.read_blocks(block_ids)
        self.used_bytes += size
        return True

    def swap_in(self, request_id: str, block_ids: list[int]) -> None:
        rows = self._saved.pop(request_id)
        if rows.shape[0] != len(block_ids):
            raise ValueError(f"{request_id}: {rows.shape[0]} blocks swapped out, {len(block_ids)} to fill")
        self.runner.write_blocks(block_ids, rows)
        self.used_bytes -= rows.numel()

    def drop(self, request_id: str) -> None:
        rows = self._saved.pop(request_id, None)
        if rows is not None:
            self.used_bytes -= rows.numel()
