"""Blocks another engine computed, written into free blocks of this engine's pool and cached
under their hashes, so that the request sent next finds them as ordinary prefix hits (the
decode side of disaggregated prefill on one GPU host)."""
from __future__ import annotations

import torch

from kvos.cache.block import BlockHash
from kvos.cache.kv_manager import KVCacheManager
from kvos.worker import peer_channel
from kvos.worker.device_rows import RankRows
from kvos.worker.peer_channel import PeerRows
from kvos.worker.runner import ModelRunner
from kvos.worker.timed_copies import TimedCopies


class BlockAdopter:
    """Engine thread only, between steps.

    Invariants: a block is cached under a hash only once its bytes are queued to be written
    (on the current stream, so before any later step reads it); adopted blocks end unreferenced
    (evictable like any cached block); blocks whose hash this pool already holds are skipped.
    The source rows (another process's memory, mapped) are kept referenced until the copy
    that reads them has run on the device; they must be complete when ``adopt`` is called (the
    sender synchronises its gather before it shares them), as the copy waits for nothing.
    """

    def __init__(self, kv: KVCacheManager, runner: ModelRunner) -> None:
        self.kv = kv
        self.runner = runner
        self._copies = TimedCopies(runner.device) if runner.device.type == "cuda" else None
        self.blocks = 0
        self.bytes = 0

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
        if isinstance(rows, RankRows):  # each rank copies its part from its peer rank's GPU
            self.runner.write_shared_rows([b.block_id for b in blocks], rows, todo)
            return self._cache(blocks, todo, hashes, parent, depth, self.runner.block_bytes)
        if isinstance(rows, PeerRows):  # each rank pulls its part over its channel (or it was pulled already)
            try:
                self.runner.write_peer_rows([b.block_id for b in blocks], rows, todo)
            except Exception:
                pool.free_blocks(reversed(blocks))  # not cached: the request computes them
                raise
            return self._cache(blocks, todo, hashes, parent, depth, self.runner.block_bytes)
        span = rows[todo[0]: todo[-1] + 1]
        if self._copies is not None and rows.device.type == "cuda":  # one peer DMA beside the steps, then a local scatter
            span = self._copies.copy(span)
        local = [i - todo[0] for i in todo]
        self.runner.write_blocks([b.block_id for b in blocks], span if len(local) == len(span) else span[local])
        return self._cache(blocks, todo, hashes, parent, depth, rows.shape[1])

    def _cache(self, blocks: list, todo: list[int], hashes: list[BlockHash], parent: BlockHash | None, depth: int,
               block_bytes: int) -> int:
        """Cache the written ``blocks`` (rows ``todo``) under their hashes and let them go."""
        pool = self.kv.pool
        self.blocks += len(blocks)
        self.bytes += len(blocks) * block_bytes
        for i, block in zip(todo, blocks):  # adopted: not this engine's to write through
            pool.cache_full_block(block, hashes[i], hashes[i - 1] if i else parent, depth=depth + i, adopted=True)
        pool.free_blocks(reversed(blocks))
        return len(blocks)

    def warm(self, rows: torch.Tensor) -> None:
        """Any thread, as soon as another GPU's ``rows`` arrive (before ``adopt`` at the next
        step boundary): wake the peer link with a small read of them (``TimedCopies.warm``)."""
        if self._copies is not None and isinstance(rows, torch.Tensor) and rows.device.type == "cuda":
            self._copies.warm(rows)

    @property
    def used(self) -> bool:
        return self.blocks > 0 or (self._copies is not None and self._copies.warm_copies > 0)

    @property
    def busy(self) -> bool:
        return self._copies is not None and self._copies.busy

    def collect(self) -> None:
        """Drop the source rows whose copies have run."""
        if self._copies is not None:
            self._copies.collect()

    def stats(self) -> dict:
        """``adopt_copy_bytes / adopt_copy_s``: the peer copies' rate over the link (device time
        of the copies alone, not the local scatter after them), and per size class the spread of
        the copies' own rates (``_spread``); ``adopt_warm_*``: the reads that woke the link
        ahead of them; ``p2p_received_*``: rank 0's pulls over point-to-point channels (wall time
        of each, the sender's answer included), ``p2p_setup_*`` of them each channel's first,
        which also made the channel."""
        c = self._copies
        inbox = peer_channel.inbox(self.runner.device)  # rank 0's parts pulled over p2p channels
        shared = 0, 0.0  # tensor parallelism: rank 0's part, copied by the runner (each rank its own)
        if self.runner.device.type == "cuda":
            self.runner.collect_shared_copies()
            shared = self.runner.shared_copy_bytes, self.runner.shared_copy_s
        return {"adopted_blocks": self.blocks, "adopted_bytes": self.bytes,
                "adopt_copy_bytes": (c.bytes if c else 0) + shared[0],
                "adopt_copy_s": (c.seconds if c else 0.0) + shared[1],
                "adopt_copies_by_size": dict(c.by_size) if c else {},
                "adopt_copy_gb_s_spread": {k: _spread(v) for k, v in c.rates.items()} if c else {},
                "adopt_warm_copies": c.warm_copies if c else 0, "adopt_warm_bytes": c.warm_bytes if c else 0,
                "adopt_warm_s": c.warm_seconds if c else 0.0,
                "p2p_received_bytes": inbox.received_bytes, "p2p_received_s": inbox.received_s,
                "p2p_setup_bytes": inbox.setup_bytes, "p2p_setup_s": inbox.setup_s}


def _spread(rates: list[float]) -> dict:
    """p10 / p50 / p90 of per-copy GB/s (nearest rank)."""
    r = sorted(rates)
    return {f"p{q}": r[min(len(r) - 1, len(r) * q // 100)] for q in (10, 50, 90)} if r else {}
