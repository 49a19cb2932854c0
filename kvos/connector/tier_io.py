"""Block bytes between the device KV tensor and the tiers: batched stores, batched loads that
copy on a side CUDA stream."""
from __future__ import annotations

import os
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch

from kvos.cache.block import BlockHash
from kvos.cache.tiers import TierHierarchy
from kvos.connector.staged_rows import StagedRows
from kvos.worker.block_digest import block_digests, page_digests
from kvos.worker.host_copies import as_tensor

DIGEST_PIPELINE_BYTES = 32 << 20
"""A load digests its staged rows in chunks of this size as their copies complete (on a GPU, on
a second stream), so only the last chunk's digest is left when the last copy lands."""
COPY_RUN_BYTES = 16 << 20
"""Most bytes of consecutive CPU-tier slots a load moves in one copy: large enough for the copy
engine's full rate, small enough that the first copy starts early."""


@dataclass
class LoadedBlocks:
    """The verified leading blocks of a load, staged on the KV tensor's device."""

    sources: list[str]
    """The tier each block came from, in order."""
    rows: torch.Tensor
    """``uint8 [len(sources), block_bytes]``, each row a block as ``ModelRunner.read_blocks`` makes
    it; rows may lie further apart than ``block_bytes`` (``StagedRows``)."""
    ready: torch.cuda.Event | None
    """On a GPU: recorded on the copy stream after the last copy into ``rows``."""


def host_digest(data: bytes | memoryview) -> int:
    """``block_digests`` of one payload on the host (the slow path of a ``DigestCodec``)."""
    return int(block_digests(as_tensor(data).view(1, -1))[0])


class TierIO:
    """Moves block bytes between the runner's KV tensor and a ``TierHierarchy``.

    Threads: ``store`` and ``fetch`` run only on the engine's single tier I/O thread, in the
    order they were submitted; ``install`` only on the engine thread. Every tier write therefore
    happens on that one thread, which is what makes CPU-tier slot reuse safe: a payload from
    ``Tier.get`` may alias a slot that the next put into the tier rewrites, and no put can run
    while ``fetch`` still uses its payloads. ``fetch`` finds the blocks (finding writes no slot)
    and copies each out, waits until the copies are complete and every find has ended (also
    when it fails midway), and only then promotes lower-tier hits (puts, which may evict and
    rewrite slots) and returns, letting the next store run. The finds run on ``verify_threads``
    helper threads (checksums dominate a load, and xxh3 releases the GIL); they only read tiers,
    and only while ``fetch`` waits for them. A CPU tier with digest frames (``CPUTier.digests``,
    the engine's choice on a GPU) is not hashed on the host at all: its blocks are copied first,
    then ``block_digests`` of the copied rows runs on the device (on a second stream, a chunk at a
    time as the copies land, overlapping the later copies), and the load keeps only the
    blocks before the first that differs from its frame's digest (``Tier.reject`` drops that
    one), all before ``fetch`` returns, so no step ever reads an unverified block. Stores into
    it take the digests that ``ModelRunner.read_blocks`` computed on the device.

    On a GPU each block's host-to-device copy is issued on a dedicated copy stream as soon as
    its checksum is verified (verifying later blocks overlaps the DMA of this one), into one
    staging tensor per load (``StagedRows``: blocks in consecutive CPU-tier slots move in one
    copy of up to ``COPY_RUN_BYTES``). CPU-tier slots are page-locked memory (``PageLockedAllocator``), so a copy
    from a slot is a direct asynchronous DMA; payloads from the disk or Redis tiers are
    pageable bytes, which CUDA stages itself. The staging tensor is allocated on the copy
    stream; ``install`` makes the compute stream wait for ``ready`` and marks the tensor used
    there, so the allocator does not reuse it before the scatter has run. A load holds
    about ``n_blocks * block_bytes`` of device memory from ``fetch`` until its ``install``; if that
    allocation fails, the fetch raises and the prefix is recomputed.
    """

    def __init__(self, hierarchy: TierHierarchy, runner, verify_threads: int | None = None) -> None:
        self.h = hierarchy
        self.runner = runner
        self.device: torch.device = runner.device
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.digest_stream = torch.cuda.Stream(self.device) if self.stream is not None else None
        """Digests a load's rows chunk by chunk while the copy stream still copies later blocks."""
        self.verify_threads = verify_threads or min(8, max(1, (os.cpu_count() or 1) // 2))
        self.verifiers = ThreadPoolExecutor(self.verify_threads, thread_name_prefix="kvos-tier-verify")
        self.digests = any(getattr(t, "digests", False) for t in hierarchy.tiers)
        """Some tier keeps digest frames: stores pass digests and loads digest their rows."""
        first = next((t for t in hierarchy.tiers if t.receives_stores), None)
        ranks = getattr(runner, "size", 1)  # tensor parallelism: a row is every rank's part (``ParallelRunner``),
        # read and written through the runner, never straight from this process's pages
        if ranks > 1 and self.digests:
            raise ValueError("tier_verify 'device': not with tensor parallelism (digests are per rank)")
        self.slots = first if hasattr(first, "reserve") and ranks == 1 else None
        """The CPU tier when it is the first tier stores reach: write-through copies blocks from
        the device straight into its slots (``store_computed``; one rank only)."""

    def store_computed(self, hashes: list[BlockHash], block_ids: list[int],
                       after: torch.cuda.Event | None, group: int | None = None,
                       parents: list[BlockHash | None] | None = None) -> None:
        """I/O thread: write-through of blocks of cache group ``group`` (None: the only one)
        that a step just computed, stored under ``hashes`` (their tier keys), read from the device pages
        on the copy stream once ``after`` (recorded on the compute stream after that step) has
        passed. Into the CPU tier's slots directly (reserved, filled by one device-to-host copy
        each, framed once the copies are complete, with digests computed on the device), then
        from those slots into the lower tiers; without a CPU tier, through host rows.

        Safety: the caller holds a reference on every block until this returns, so no later step
        rewrites them (a cached block is immutable while referenced)."""
        pages = self.runner.block_pages(group)
        with torch.cuda.stream(self.stream):  # a no-op without a stream (CPU)
            if after is not None and self.stream is not None:
                self.stream.wait_event(after)
            if self.slots is None:
                self.store(hashes, self.runner.read_blocks(block_ids, group=group), False, parents=parents)
                return
            digests = page_digests(pages, block_ids) if self.slots.digests else None
            host_digests = None
            lower = [t for t in self.h.tiers if t.receives_stores and t is not self.slots]
            todo = list(range(len(block_ids)))
            self.slots.expect(hashes)
            while todo:  # one round, unless the tier is full of blocks waiting requests want
                t_round = time.perf_counter()
                reserved: list[tuple[int, BlockHash, int, memoryview]] = []
                try:
                    rest = []
                    for n, i in enumerate(todo):
                        got = self.slots.reserve(hashes[i], pages.shape[1], evict_wanted=not reserved)
                        if got is None and self.slots.contains(hashes[i]):  # stored already: a use, as a put's
                            if reserved:  # at its turn: after this round's blocks are bound
                                rest = todo[n:]
                                break
                            self.slots.touch(hashes[i])
                            continue
                        if got is False:  # as a put would: this round's blocks go first
                            rest = todo[n:]
                            break
                        if got is not None:
                            as_tensor(got[1]).copy_(pages[block_ids[i]], non_blocking=True)
                            reserved.append((i, hashes[i], *got))
                    if host_digests is None and digests is not None:
                        host_digests = digests.tolist()
                    if self.stream is not None:
                        self.stream.synchronize()
                except BaseException:
                    for _, _, slot, _ in reserved:
                        self.slots.release(slot)
                    raise
                for i, key, slot, payload in reserved:
                    self.slots.commit(key, slot, host_digests[i] if host_digests is not None else None,
                                      parents[i] if parents is not None else None)
                with self.slots.lock:
                    self.slots.stats.store_seconds += time.perf_counter() - t_round
                for i, key, _, payload in reserved:  # a payload view is valid until the next put into the tier
                    for tier in lower:
                        t0 = time.perf_counter()
                        tier.put(key, payload, host_digests[i] if host_digests is not None else None,
                                 parents[i] if parents is not None else None)
                        tier.stats.store_seconds += time.perf_counter() - t0
                todo = rest

    def store(self, hashes: list[BlockHash], rows: torch.Tensor, evicted: bool,
              digests: list[int] | None = None, parents: list[BlockHash | None] | None = None) -> None:
        """I/O thread: store host ``rows`` (from ``read_blocks``, with its ``digests`` when
        ``self.digests``) under ``hashes`` (``parents``: each one's chain parent key); the
        caller's reference keeps ``rows`` alive until this returns."""
        table = rows.numpy()
        for i, key in enumerate(hashes):
            self.h.store(key, table[i].data, evicted, None if digests is None else digests[i],
                         None if parents is None else parents[i])

    def fetch(self, hashes: list[BlockHash], group: int | None = None) -> LoadedBlocks:
        """I/O thread: the leading ``hashes`` (tier keys of cache group ``group``'s blocks; None:
        the only group) some tier holds, verified and staged on the device (stops at the first
        miss or failed checksum); returns once the copies are complete."""
        bb = self.runner.group_block_bytes(0 if group is None else group)  # (every rank's part)
        found: list[tuple[BlockHash, bytes | memoryview, int, int | None]] = []
        ready = None
        digests: list[int] = []
        finds: list[Future] = []
        first = self.h.tiers[0] if self.h.tiers else None
        per_digest = max(1, DIGEST_PIPELINE_BYTES // bb)
        with torch.cuda.stream(self.stream):  # a no-op without a stream (CPU)
            try:
                staged = StagedRows(len(hashes), bb, getattr(first, "payload_stride", lambda: bb)(),
                                    self.device, COPY_RUN_BYTES)
                rows = staged.rows
                dig = torch.empty(len(hashes), dtype=torch.int64, device=self.device) if self.digests else None
                digested = 0

                def digest_copied() -> None:
                    """Queue the digests of the rows whose copies are queued and not yet digested,
                    on the digest stream behind those copies (on the CPU, where copies are
                    synchronous: computed now)."""
                    nonlocal digested
                    n = staged.issued
                    if dig is None or n == digested:
                        return
                    if self.digest_stream is not None:
                        self.digest_stream.wait_stream(self.stream)
                    with torch.cuda.stream(self.digest_stream):
                        dig[digested:n] = block_digests(rows[digested:n])
                    digested = n

                def issue(key: BlockHash, got) -> bool:
                    """Stage a found block; False at a miss or a wrong size."""
                    if got is None or len(got[0]) != bb:
                        return False
                    staged.add(got[0])  # a CPU-tier payload aliases a pinned slot: asynchronous DMA
                    found.append((key, *got))
                    if staged.issued - digested >= per_digest:
                        digest_copied()
                    return True

                stopped = False
                if getattr(first, "digests", False):  # nothing to hash: each leading hit's copy is issued
                    for key in hashes:                # as soon as it is found, overlapping the next finds
                        got = first.get_for_load(key) if first.contains(key) else None
                        if not issue(key, None if got is None else (got[0], 0, got[1])):
                            stopped = got is not None
                            break
                if not stopped:
                    finds = [self.verifiers.submit(self.h.find, key) for key in hashes[len(found):]]
                for key, fut in zip(hashes[len(found):], finds):
                    if not issue(key, fut.result()):
                        break
                staged.flush()
                digest_copied()
            finally:  # no slot may be rewritten while a find or a copy still reads it
                for fut in finds:
                    fut.cancel()
                wait(finds)
                if self.stream is not None:
                    ready = torch.cuda.Event()
                    ready.record(self.stream)
                    ready.synchronize()
                    self.digest_stream.synchronize()
            if dig is not None and found:
                digests = dig[: len(found)].tolist()
        for i, (key, data, tier, expect) in enumerate(found):
            if expect is not None and expect != digests[i]:
                self.h.tiers[tier].reject(key, len(data))
                del found[i:]
                break
        by_tier: dict[int, list[BlockHash]] = {}
        for key, _, tier, _ in found:  # each tier hears its part of the chain as one use, root first
            by_tier.setdefault(tier, []).append(key)
        for tier, keys in by_tier.items():
            self.h.tiers[tier].note_hits(keys)
        for i, (key, data, tier, _) in enumerate(found):
            self.h.promote(key, data, tier, digests[i] if digests else None)
        return LoadedBlocks([self.h.tiers[t].name for _, _, t, _ in found], rows[: len(found)], ready)

    def install(self, loaded: LoadedBlocks, block_ids: list[int], group: int | None = None) -> None:
        """Engine thread: scatter ``loaded`` into the first blocks of ``block_ids`` (of cache group
        ``group``) with one device-side copy on the compute stream (only into blocks of a request
        still loading)."""
        if not loaded.sources:
            return
        if loaded.ready is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(loaded.ready)
            loaded.rows.record_stream(compute)
        self.runner.write_blocks(block_ids[: len(loaded.sources)], loaded.rows, group=group)

    def close(self) -> None:
        self.verifiers.shutdown(wait=True)
