"""Start a real ``kvos serve`` subprocess on a free loopback port."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
        # a file, not a pipe: an unread pipe fills up and blocks the server's logging
        self.log = tempfile.NamedTemporaryFile("w+", prefix="kvos-serve-", suffix=".log", delete=False)
        self.proc = subprocess.Popen([sys.executable, "-m", "kvos.cli", "serve", "--port", str(self.port), *args],
                                     stdout=self.log, stderr=subprocess.STDOUT, text=True, env=env)

    def wait_ready(self, timeout: float = 180) -> Server:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.output()[-4000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError("server did not become ready")

    def output(self) -> str:
        return Path(self.log.name).read_text()

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def metric(self, name: str, labels: str = "") -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        key = f"{name}{{{labels}}}" if labels else name
        for line in text.splitlines():
            if line.startswith(key + " "):
                return float(line.split()[-1])
        raise KeyError(key)


def engines(server) -> dict[int, dict]:
    """Per engine from /metrics: pid, up, running."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    out: dict[int, dict] = {}
    for e, pid in re.findall(r'kvos:engine_info\{engine="(\d+)",pid="(\d+)"\} 1', text):
        out[int(e)] = {"pid": int(pid)}
    for name, key in (("kvos:engine_up", "up"), ("kvos:engine_num_requests_running", "running")):
        for e, v in re.findall(rf'{name}\{{engine="(\d+)"\}} (\S+)', text):
            out.setdefault(int(e), {})[key] = float(v)
    return out


def wait_until(cond, timeout: float = 120) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise TimeoutError("condition not met")
        time.sleep(0.2)
