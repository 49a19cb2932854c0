"""Host memory for preemption by swap."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvos.cache.kv_manager import KVCacheManager

GIB = 1 << 30


@dataclass
class _SwappedGroup:
    positions: list[int]
    """Table positions whose blocks were saved (a sliding-window group's blocks behind the
    window are null placeholders then, and saved as nothing)."""
    rows: torch.Tensor | None


class HostSwapSpace:
    """Keeps preempted sequences' block bytes in host memory (pinned on a GPU), up to
    ``capacity_bytes``; when full, ``swap_out`` declines and the sequence is recomputed
    instead. Each direction is one batched copy (``read_blocks``/``write_blocks``) per cache
    group.

    Every cache group's blocks are saved: the scheduler names the sequence's first ``n`` block
    positions (by group 0's ids) and each group's blocks at those positions are read from the
    manager's tables (``kv.block_tables``) before the sequence is freed. On swap-in the rows go
    back to the same positions of the fresh tables; a sliding-window group's positions that held
    null placeholders (behind the window) are freed unwritten (``KVCacheManager.drop_unneeded``),
    so nothing registers them when the scheduler caches the restored blocks.
    """

    def __init__(self, runner, capacity_bytes: int, kv: KVCacheManager) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"swap_space_gb must be > 0, got {capacity_bytes / GIB}")
        self.runner = runner
        self.kv = kv
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._saved: dict[str, list[_SwappedGroup]] = {}

    def swap_out(self, request_id: str, block_ids: list[int]) -> bool:
        n = len(block_ids)
        tables = self.kv.block_tables(request_id)
        if [b.block_id for b in tables[0][:n]] != block_ids:
            raise ValueError(f"{request_id}: block_ids are not the first {n} of its group-0 table")
        positions = [[i for i, b in enumerate(t[:n]) if not b.is_null] for t in tables]
        size = sum(len(p) * self.runner.group_block_bytes(g) for g, p in enumerate(positions))
        if self.used_bytes + size > self.capacity_bytes:
            return False
        self._saved[request_id] = [
            _SwappedGroup(p, self.runner.read_blocks([tables[g][i].block_id for i in p], group=g) if p else None)
            for g, p in enumerate(positions)]
        self.used_bytes += size
        return True

    def swap_in(self, request_id: str, block_ids: list[int]) -> None:
        saved = self._saved.pop(request_id)
        self.used_bytes -= self._size(saved)
        n = len(block_ids)
        tables = self.kv.block_tables(request_id)
        for g, (group, table) in enumerate(zip(saved, tables)):
            if group.positions and group.positions[-1] >= n:
                raise ValueError(f"{request_id}: {group.positions[-1] + 1} blocks swapped out, {n} to fill")
            if group.rows is not None:
                self.runner.write_blocks([table[i].block_id for i in group.positions], group.rows, group=g)
            kept = set(group.positions)
            missing = [i for i in range(n) if i not in kept]
            if missing:
                self.kv.drop_unneeded(request_id, g, missing)

    def drop(self, request_id: str) -> None:
        saved = self._saved.pop(request_id, None)
        if saved is not None:
            self.used_bytes -= self._size(saved)

    @staticmethod
    def _size(saved: list[_SwappedGroup]) -> int:
        return sum(g.rows.numel() for g in saved if g.rows is not None)
