"""A real redis-server on a random loopback port, for tests."""
from __future__ import annotations

import shutil
import subprocess
import time

import redis

from tests.support.server import free_port


class RedisServer:
    def __init__(self, port: int | None = None) -> None:
        exe = shutil.which("redis-server") or shutil.which("valkey-server")
        if exe is None:  # .ci/ensure-redis installs it in CI; elsewhere say why these tests skip
            import pytest

            pytest.skip("redis-server is not installed (apt-get install redis-server)")
        self.exe = exe
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> RedisServer:
        self.proc = subprocess.Popen([self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port)
        for _ in range(100):
            try:
                client.ping()
                return self
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None
