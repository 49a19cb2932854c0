"""Remote tier on Redis or Valkey, shared by engines."""
from __future__ import annotations

import time

from kvos.cache.block import BlockHash
from kvos.cache.tiers.base import Tier
from kvos.cache.tiers.codec import PLAIN, Codec


class RedisTier(Tier):
    """Keys ``kvos:block:<hash hex>`` with an LRU bound set on the server side
    (``maxmemory`` + ``allkeys-lru`` is the operator's choice) and a client-side byte budget
    used only for reporting. When Redis is down or slow (timeouts), the tier is skipped for
    ``retry_after_s`` and then tried again; callers only ever see misses.

    Values are frames bound to their key (``codec``): a value copied under another key, or
    written by an engine with another encryption key, is a miss and is deleted. With a sealed
    codec (``--tier-encryption-key-file``) the server only ever holds AES-GCM ciphertext; key
    names (block hashes) stay visible."""

    name = "remote"
    PREFIX = "kvos:block:"

    def __init__(self, url: str, capacity_bytes: int = 1 << 40, timeout_s: float = 0.5,
                 retry_after_s: float = 2.0, codec: Codec = PLAIN) -> None:
        super().__init__(capacity_bytes, codec)
        try:
            import redis
        except ImportError as e:  # pragma: no cover - declared dependency
            raise ImportError("the remote tier needs the `redis` package") from e
        if not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"remote_cache must be a redis:// URL, got {url!r}")
        self.url = url
        self.client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self.retry_after_s = retry_after_s
        self._down_until = 0.0
        self._stored = 0

    @property
    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    def _call(self, fn, default):
        if not self.available:
            return default
        try:
            return fn()
        except Exception:  # connection refused, timeout, server error: skip the tier for a while
            self.stats.errors += 1
            self._down_until = time.monotonic() + self.retry_after_s
            return default

    def contains(self, key: BlockHash) -> bool:
        return bool(self._call(lambda: self.client.exists(self.PREFIX + key.hex()), False))

    def contains_many(self, keys: list[BlockHash]) -> list[bool]:
        """One pipelined round trip of ``EXISTS`` per key (no transaction); all False while the
        tier is down, and a timeout marks it down for ``retry_after_s``."""
        if not keys:
            return []

        def exists_all() -> list[bool]:
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(self.PREFIX + key.hex())
            return [bool(n) for n in pipe.execute()]

        return self._call(exists_all, [False] * len(keys))

    def _read(self, key: BlockHash) -> bytes | None:
        return self._call(lambda: self.client.get(self.PREFIX + key.hex()), None)

    def _write(self, key: BlockHash, data: bytes | memoryview, digest: int | None = None,
               parent: BlockHash | None = None) -> bool:
        blob = self.codec.encode(key, data)
        ok = self._call(lambda: self.client.set(self.PREFIX + key.hex(), blob), None)
        if ok:
            self._stored += len(blob)
        else:
            self.stats.skipped_writes += 1
        return bool(ok)

    def _drop(self, key: BlockHash) -> None:
        self._call(lambda: self.client.delete(self.PREFIX + key.hex()), None)

    def used_bytes(self) -> int:
        return self._stored
