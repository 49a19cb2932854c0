"""A prefill engine's finished prompts, held for the decode engine that will take them.

When an exporting request finishes, its prompt's cached blocks get a reference at once (on the
stepping thread, between steps), so no later step can evict or rewrite them; nothing is copied
yet. ``take`` (any thread, no step boundary to wait for) then reads only the blocks the decode
engine lacks, on a stream of its own, and hands the references back to the stepping thread.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

from kvos.cache.block import KVBlock
from kvos.distributed.kv_transfer import ExtractedBlocks

log = logging.getLogger("kvos.distributed")

EMPTY = ExtractedBlocks([], None, 0, None)


@dataclass
class _Held:
    hashes: list[bytes]
    blocks: list[KVBlock]
    """Referenced: their bytes stay as computed until released on the stepping thread."""
    transfer: str
    """``kv_transfer.TRANSFERS``: the form ``take`` hands the rows over in."""
    ready_event: object | None
    """CUDA event after the step that computed them (the reads wait for it)."""
    since: float


class BlockExports:
    """Thread rules: ``expect``, ``hold`` and ``release_expired`` on the stepping thread;
    ``take`` on any other thread. ``release`` (a callable the owner provides) queues blocks to
    be freed on the stepping thread."""

    MAX_SHARED_BYTES = 4 << 30
    """Device rows shared with decode engines and not yet reported done (``done``) at most;
    past it, takes return host rows (the memory is outside the KV pool)."""

    TTL_S = 60.0
    """A held export nobody takes in this long is released."""

    def __init__(self, engine, release: Callable[[list[KVBlock]], None]) -> None:
        self.engine = engine
        self.release = release
        self._cond = threading.Condition()
        self._expected: dict[str, tuple[list[bytes], bool]] = {}
        self._held: dict[str, _Held] = {}
        self._shared_bytes = 0
        self._stream = None

    def expect(self, request_id: str, hashes: list[bytes], transfer: str) -> None:
        with self._cond:
            self._expected[request_id] = (hashes, transfer)

    @property
    def pending(self) -> bool:
        return bool(self._expected) or bool(self._held)

    def hold(self, request_id: str) -> None:
        """Stepping thread: ``request_id`` finished (or was dropped): reference its cached
        prompt blocks for ``take``."""
        with self._cond:
            job = self._expected.get(request_id)
        if job is None:
            return
        hashes, transfer = job
        pool = self.engine.kv.pool
        blocks: list[KVBlock] = []
        for h in hashes:
            b = pool.lookup(h)
            if b is None:
                break
            blocks.append(b)
        pool.touch(blocks)
        event = None
        if self.engine.runner.device.type == "cuda":
            import torch

            event = torch.cuda.Event()
            event.record()
        with self._cond:
            if request_id in self._expected:
                self._held[request_id] = _Held(hashes[: len(blocks)], blocks, transfer, event, time.monotonic())
                self._cond.notify_all()
            else:
                self.release(blocks)

    def release_expired(self, now: float) -> None:
        with self._cond:
            old = [r for r, h in self._held.items() if now - h.since > self.TTL_S]
            for r in old:
                self._expected.pop(r, None)
                self.release(self._held.pop(r).blocks)

    def take(self, request_id: str, skip: int, timeout_s: float = 60.0) -> ExtractedBlocks:
        """The export's blocks after the first ``skip`` (the ones the receiver lacks), read now
        on a side stream (waits for the request to finish, up to ``timeout_s``); empty if it
        failed, was aborted or expired."""
        end = time.monotonic() + timeout_s
        with self._cond:
            while request_id in self._expected and request_id not in self._held:
                left = end - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            self._expected.pop(request_id, None)
            held = self._held.pop(request_id, None)
        if held is None:
            return EMPTY
        try:
            return self._read(held, skip)
        finally:
            self.release(held.blocks)

    def done(self, nbytes: int) -> None:
        with self._cond:
            self._shared_bytes = max(0, self._shared_bytes - nbytes)

    def _read(self, held: _Held, skip: int) -> ExtractedBlocks:
        """Blocks ``held.blocks[skip:]``: while referenced, their bytes are immutable, so reading
        them beside the steps is safe; returns once the read is complete (the references may go)."""
        blocks = held.blocks[skip:]
        if not blocks:
            return EMPTY
        runner = self.engine.runner
        ids = [b.block_id for b in blocks]
        nbytes = len(ids) * runner.block_bytes
        on_gpu = runner.device.type == "cuda"
        with self._cond:
            share = ((held.transfer == "ipc" and on_gpu) or held.transfer == "p2p") and \
                self._shared_bytes + nbytes <= self.MAX_SHARED_BYTES
            if share:
                self._shared_bytes += nbytes
        if on_gpu and self._stream is None:
            import torch

            self._stream = torch.cuda.Stream(device=runner.device)
        with _on_stream(self._stream if on_gpu else None):
            if held.ready_event is not None:
                self._stream.wait_event(held.ready_event)
            if share:  # DeviceRows (RankRows from a tensor-parallel runner), or PeerRows
                try:
                    rows: object = runner.share_blocks(ids) if held.transfer == "ipc" else runner.hold_blocks(ids)
                except BaseException:
                    self.done(nbytes)
                    raise
            else:
                rows = runner.read_blocks(ids).numpy()
        return ExtractedBlocks(held.hashes[skip:], blocks[0].parent_hash, blocks[0].depth, rows)


def _on_stream(stream):
    """``torch.cuda.stream(stream)``, or nothing without one (the CPU: torch not needed)."""
    if stream is None:
        return nullcontext()
    import torch

    return torch.cuda.stream(stream)
