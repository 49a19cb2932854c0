"""Blocks another engine computed, written into free blocks of this engine's pool and cached
under their hashes, so that the request sent next finds them as ordinary prefix hits (the
decode side of disaggregated prefill on one GPU host)."""
from __future__ import annotations

import torch

from kvos.cache.block import BlockHash
from kvos.cache.kv_manager import KVCacheManager
from kvos.model.runner import ModelRunner


class BlockAdopter:
    """Engine thread only, between steps.

    Invariants: a block is cached under a hash only once its bytes are queued to be written
    (on the current stream, so before any later step reads it); adopted blocks end unreferenced
    (evictable like any cached block); blocks whose hash this pool already holds are skipped.
    The source rows (another process's memory, mapped) are kept referenced until the copy
    that reads them has run on the device.
    """

    def __init__(self, kv: KVCacheManager, runner: ModelRunner) -> None:
        self.kv = kv
        self.runner = runner
        self._reading: list[tuple[torch.cuda.Event | None, torch.cuda.Event | None, torch.Tensor]] = []
        self.blocks = 0
        self.bytes = 0
        self.copy_s = 0.0
        """Device time of the peer copies done (CUDA events around the copy alone, not the
        local scatter after it): ``bytes / copy_s`` is the rate over the link."""

    def adopt(self, hashes: list[BlockHash], parent: BlockHash | None, rows: torch.Tensor, depth: int = 0) -> int:
        """Cache ``rows[i]`` under ``hashes[i]`` (a chain whose first parent is ``parent``, the
        first block ``depth``-th of it); returns how many blocks were written. Takes free
        blocks only as the pool can give them (evicting the policy's choice, as any allocation
        does); what does not fit is skipped, and the request computes it."""
        self.collect()
        pool = self.kv.pool
        todo = [i for i, h in enumerate(hashes) if pool.lookup(h) is None]
        todo = todo[: pool.num_free_blocks()]
        if not todo:
            return 0
        blocks = pool.get_new_blocks(len(todo))
        span = rows[todo[0]: todo[-1] + 1]
        start = end = None
        if rows.device.type == "cuda":  # one peer DMA of the span (copy engines), then a local scatter
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            span = torch.empty_like(span).copy_(span)
            end.record()
        local = [i - todo[0] for i in todo]
        self.runner.write_blocks([b.block_id for b in blocks], span if len(local) == len(span) else span[local])
        self._reading.append((start, end, rows))
        self.blocks += len(blocks)
        self.bytes += len(blocks) * rows.shape[1]
        saved, pool.newly_cached = pool.newly_cached, None  # (not this engine's to write through)
        try:
            for i, block in zip(todo, blocks):
                pool.cache_full_block(block, hashes[i], hashes[i - 1] if i else parent, depth=depth + i)
        finally:
            pool.newly_cached = saved
        pool.free_blocks(reversed(blocks))
        return len(blocks)

    @property
    def busy(self) -> bool:
        return bool(self._reading)

    def collect(self) -> None:
        """Drop the source rows whose copies have run."""
        while self._reading and (self._reading[0][1] is None or self._reading[0][1].query()):
            start, end, _ = self._reading.pop(0)
            if start is not None and end is not None:
                self.copy_s += start.elapsed_time(end) / 1000

    def stats(self) -> dict:
        return {"adopted_blocks": self.blocks, "adopted_bytes": self.bytes, "adopt_copy_s": self.copy_s}
