"""Block bytes between the device KV tensor and the tiers: batched stores, batched loads that
copy on a side CUDA stream."""
from __future__ import annotations

import os
import warnings
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch

from kvos.cache.block import BlockHash
from kvos.cache.tiers import TierHierarchy


@dataclass
class LoadedBlocks:
    """The verified leading blocks of a load, staged on the KV tensor's device."""

    sources: list[str]
    """The tier each block came from, in order."""
    rows: torch.Tensor
    """``uint8 [len(sources), block_bytes]``, rows as ``ModelRunner.read_blocks`` makes them."""
    ready: torch.cuda.Event | None
    """On a GPU: recorded on the copy stream after the last copy into ``rows``."""


def _as_tensor(data: bytes | memoryview) -> torch.Tensor:
    """A uint8 tensor aliasing ``data`` (no copy). Read-only buffers (bytes from the disk or
    Redis tier) are only ever read through it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "buffer is not writable"
        return torch.frombuffer(data, dtype=torch.uint8)


class TierIO:
    """Moves block bytes between the runner's KV tensor and a ``TierHierarchy``.

    Threads: ``store`` and ``fetch`` run only on the engine's single tier I/O thread, in the
    order they were submitted; ``install`` only on the engine thread. Every tier write therefore
    happens on that one thread, which is what makes CPU-tier slot reuse safe: a payload from
    ``Tier.get`` may alias a slot that the next put into the tier rewrites, and no put can run
    while ``fetch`` still uses its payloads. ``fetch`` finds all blocks first (finding writes no
    slot), copies each out, waits until the copies are complete and every find has ended (also
    when it fails midway), and only then promotes lower-tier hits (puts, which may evict and
    rewrite slots) and returns, letting the next store run. The finds run on ``verify_threads``
    helper threads (checksums dominate a load, and xxh3 releases the GIL); they only read tiers,
    and only while ``fetch`` waits for them.

    On a GPU each block's host-to-device copy is issued on a dedicated copy stream as soon as
    its checksum is verified (verifying later blocks overlaps the DMA of this one), into one
    staging tensor per load. CPU-tier slots are pinned memory (``PinnedAllocator``), so a copy
    from a slot is a direct asynchronous DMA; payloads from the disk or Redis tiers are
    pageable bytes, which CUDA stages itself. The staging tensor is allocated on the copy
    stream; ``install`` makes the compute stream wait for ``ready`` and marks the tensor used
    there, so the allocator does not reuse it before the scatter has run. A load holds
    ``n_blocks * block_bytes`` of device memory from ``fetch`` until its ``install``; if that
    allocation fails, the fetch raises and the prefix is recomputed.
    """

    def __init__(self, hierarchy: TierHierarchy, runner, verify_threads: int | None = None) -> None:
        self.h = hierarchy
        self.runner = runner
        self.device: torch.device = runner.device
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.verify_threads = verify_threads or min(8, max(1, (os.cpu_count() or 1) // 2))
        self.verifiers = ThreadPoolExecutor(self.verify_threads, thread_name_prefix="kvos-tier-verify")

    def store(self, hashes: list[BlockHash], rows: torch.Tensor, evicted: bool) -> None:
        """I/O thread: store host ``rows`` (from ``read_blocks``) under ``hashes``; the caller's
        reference keeps ``rows`` alive until this returns."""
        table = rows.numpy()
        for i, key in enumerate(hashes):
            self.h.store(key, table[i].data, evicted)

    def fetch(self, hashes: list[BlockHash]) -> LoadedBlocks:
        """I/O thread: the leading ``hashes`` some tier holds, verified and staged on the device
        (stops at the first miss or failed checksum); returns once the copies are complete."""
        bb = self.runner.block_bytes
        found: list[tuple[BlockHash, bytes | memoryview, int]] = []
        ready = None
        finds = [self.verifiers.submit(self.h.find, key) for key in hashes]
        with torch.cuda.stream(self.stream):  # a no-op without a stream (CPU)
            try:
                rows = torch.empty(len(hashes), bb, dtype=torch.uint8, device=self.device)
                for key, fut in zip(hashes, finds):
                    got = fut.result()
                    if got is None or len(got[0]) != bb:
                        break
                    # a CPU-tier payload aliases a pinned slot: asynchronous DMA, no staging
                    rows[len(found)].copy_(_as_tensor(got[0]), non_blocking=True)
                    found.append((key, *got))
            finally:  # no slot may be rewritten while a find or a copy still reads it
                for fut in finds:
                    fut.cancel()
                wait(finds)
                if self.stream is not None:
                    ready = torch.cuda.Event()
                    ready.record(self.stream)
                    ready.synchronize()
        for key, data, tier in found:
            self.h.promote(key, data, tier)
        return LoadedBlocks([self.h.tiers[t].name for _, _, t in found], rows[: len(found)], ready)

    def install(self, loaded: LoadedBlocks, block_ids: list[int]) -> None:
        """Engine thread: scatter ``loaded`` into the first blocks of ``block_ids`` with one
        device-side copy on the compute stream (only into blocks of a request still loading)."""
        if not loaded.sources:
            return
        if loaded.ready is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(loaded.ready)
            loaded.rows.record_stream(compute)
        self.runner.write_blocks(block_ids[: len(loaded.sources)], loaded.rows)

    def close(self) -> None:
        self.verifiers.shutdown(wait=True)
