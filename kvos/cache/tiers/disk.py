"""Local-disk tier: one file per block, written atomically, index rebuilt at start."""
from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path

from kvos.cache.block import BlockHash
from kvos.cache.tiers.base import Tier
from kvos.cache.tiers.codec import encode


class DiskTier(Tier):
    """Files ``<dir>/<hash hex>.kv``. A write goes to a temporary name and is renamed into place,
    so a crash mid-write leaves no torn block; leftovers are removed at start. The LRU index is
    rebuilt from the directory (oldest modification first), so hits survive a restart. A full
    disk (or any OS error) skips the write."""

    name = "disk"
    SUFFIX = ".kv"

    def __init__(self, directory: str | os.PathLike, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes)
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._index: OrderedDict[BlockHash, int] = OrderedDict()
        self._used = 0
        files = []
        for p in self.dir.iterdir():
            if p.name.endswith(".tmp"):
                p.unlink(missing_ok=True)
            elif p.suffix == self.SUFFIX:
                try:
                    st = p.stat()
                    files.append((st.st_mtime, bytes.fromhex(p.stem), st.st_size))
                except (OSError, ValueError):
                    continue
        for _, key, size in sorted(files):
            self._index[key] = size
            self._used += size

    def _path(self, key: BlockHash) -> Path:
        return self.dir / f"{key.hex()}{self.SUFFIX}"

    def contains(self, key: BlockHash) -> bool:
        with self.lock:
            return key in self._index

    def _read(self, key: BlockHash) -> bytes | None:
        with self.lock:
            if key not in self._index:
                return None
            self._index.move_to_end(key)
        try:
            return self._path(key).read_bytes()
        except OSError:
            self.stats.errors += 1
            self._drop(key)
            return None

    def _write(self, key: BlockHash, data: bytes | memoryview) -> bool:
        blob = encode(data)
        if len(blob) > self.capacity_bytes:
            self.stats.skipped_writes += 1
            return False
        with self.lock:
            while self._used + len(blob) > self.capacity_bytes and self._index:
                old, _ = next(iter(self._index.items()))
                self._drop(old)
                self.stats.evictions += 1
        path = self._path(key)
        tmp = path.with_name(path.name + f".{os.getpid()}.{id(blob)}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(blob)
            os.replace(tmp, path)
        except OSError:  # disk full or unwritable: skip, never fail the request
            self.stats.skipped_writes += 1
            tmp.unlink(missing_ok=True)
            return False
        with self.lock:
            self._index[key] = len(blob)
            self._used += len(blob)
        return True

    def _drop(self, key: BlockHash) -> None:
        with self.lock:
            size = self._index.pop(key, None)
            if size is None:
                return
            self._used -= size
        self._path(key).unlink(missing_ok=True)

    def used_bytes(self) -> int:
        return self._used
