"""Host memory for preemption by swap."""
from __future__ import annotations

GIB = 1 << 30


class HostSwapSpace:
    """Keeps preempted sequences' block bytes in host memory, up to ``capacity_bytes``; when
    full, ``swap_out`` declines and the sequence is recomputed instead."""

    def __init__(self, runner, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"swap_space_gb must be > 0, got {capacity_bytes / GIB}")
        self.runner = runner
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._saved: dict[str, list[bytes]] = {}

    def swap_out(self, request_id: str, block_ids: list[int]) -> bool:
        data = [self.runner.read_block(b) for b in block_ids]
        size = sum(len(d) for d in data)
        if self.used_bytes + size > self.capacity_bytes:
            return False
        self._saved[request_id] = data
        self.used_bytes += size
        return True

    def swap_in(self, request_id: str, block_ids: list[int]) -> None:
        data = self._saved.pop(request_id)
        for block_id, blob in zip(block_ids, data, strict=True):
            self.runner.write_block(block_id, blob)
        self.used_bytes -= sum(len(d) for d in data)

    def drop(self, request_id: str) -> None:
        data = self._saved.pop(request_id, None)
        if data:
            self.used_bytes -= sum(len(d) for d in data)
