"""Local-disk tier: one file per block, written atomically, index rebuilt at start."""
from __future__ import annotations

import os
import stat
import warnings
from collections import OrderedDict
from pathlib import Path

from kvos.cache.block import BlockHash
from kvos.cache.tiers.base import Tier
from kvos.cache.tiers.codec import PLAIN, Codec


class DiskTier(Tier):
    """Files ``<dir>/<hash hex>.kv``. A write goes to a temporary name and is renamed into place,
    so a crash mid-write leaves no torn block; leftovers are removed at start. The LRU index is
    rebuilt from the directory (oldest modification first), so hits survive a restart. A full
    disk (or any OS error) skips the write.

    Files reveal prompts' KV, so they are private to the server's user: a directory this tier
    creates is mode 0700 (an existing one is left as it is, with a warning if group or others
    may enter it), and each file is created 0600 (``os.open`` mode; a umask can only narrow
    it). With a sealed ``codec`` (``--tier-encryption-key-file``) the payloads are AES-GCM
    encrypted as well.

    Invariant: an index entry whose file cannot be read (deleted, replaced, unreadable) or
    fails verification is dropped on that read and counted (``stats.errors`` for an OS error,
    ``stats.checksum_failures`` for a bad frame), so ``contains`` stops claiming it and the
    next store writes it again.
    """

    name = "disk"
    SUFFIX = ".kv"
    DIR_MODE = 0o700
    FILE_MODE = 0o600

    def __init__(self, directory: str | os.PathLike, capacity_bytes: int, codec: Codec = PLAIN) -> None:
        super().__init__(capacity_bytes, codec)
        self.dir = Path(directory)
        self._make_private_dir()
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

    def _make_private_dir(self) -> None:
        """Create the directory 0700 (parents as the umask says), or warn about an existing one
        that group or others may enter: it may be shared on purpose, so it is not changed."""
        try:
            self.dir.mkdir(mode=self.DIR_MODE, parents=True)
            os.chmod(self.dir, self.DIR_MODE)  # exactly 0700 whatever the umask
        except FileExistsError:
            mode = stat.S_IMODE(self.dir.stat().st_mode)
            if mode & 0o077:
                warnings.warn(f"disk_cache_dir {str(self.dir)!r} is accessible to group or others (mode "
                              f"{mode:04o}); its block files are not (0600), but chmod 700 it", stacklevel=3)

    def _path(self, key: BlockHash) -> Path:
        return self.dir / f"{key.hex()}{self.SUFFIX}"

    def contains(self, key: BlockHash) -> bool:
        with self.lock:
            return key in self._index

    def contains_many(self, keys: list[BlockHash]) -> list[bool]:
        with self.lock:
            return [k in self._index for k in keys]

    def _read(self, key: BlockHash) -> bytes | None:
        with self.lock:
            if key not in self._index:
                return None
            self._index.move_to_end(key)
        try:
            return self._path(key).read_bytes()
        except OSError:  # deleted or replaced under a running server: forget it
            self._drop(key)
            with self.lock:
                self.stats.errors += 1
            return None

    def _write(self, key: BlockHash, data: bytes | memoryview, digest: int | None = None,
               parent: BlockHash | None = None) -> bool:
        blob = self.codec.encode(key, data)
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
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), self.FILE_MODE)
            with open(fd, "wb") as f:
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
