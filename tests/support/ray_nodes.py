"""A Ray cluster of two nodes on this machine, made as a user makes one: ``ray start --head`` and
``ray start --address``, each node with a resource of its own name (``node_a``, ``node_b``).

Each ``ray start`` runs with ``--block`` as a child of the test, so stopping it (SIGTERM) ends
exactly that node's processes (``ray stop`` would end every Ray cluster of the machine, other
tests' too). A private ``--temp-dir`` keeps ``ray.init()`` without an address in other tests from
finding this cluster."""
from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from tests.support.server import free_port

RAY = str(Path(sys.executable).with_name("ray"))


def _start(args: list[str], log: Path, env: dict) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen([RAY, "start", "--block", "--disable-usage-stats", *args], stdout=out,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _wait_nodes(address: str, n: int, env: dict, procs: list[subprocess.Popen], timeout: float) -> None:
    probe = ("import ray, sys; ray.init(address=sys.argv[1], logging_level='ERROR'); "
             "sys.exit(0 if sum(x['Alive'] for x in ray.nodes()) >= int(sys.argv[2]) else 1)")
    end = time.monotonic() + timeout
    last = ""
    while time.monotonic() < end:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError("ray start exited")
        run = subprocess.run([sys.executable, "-c", probe, address, str(n)], env=env, capture_output=True, text=True,
                             timeout=timeout)
        if run.returncode == 0:
            return
        last = run.stderr[-2000:]
        time.sleep(1)
    raise TimeoutError(f"the Ray cluster at {address} did not reach {n} nodes: {last}")


def _wait_port(port: int, procs: list[subprocess.Popen], timeout: float) -> None:
    """Until the head's GCS listens."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError("ray start exited")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            return
        time.sleep(0.5)
    raise TimeoutError(f"the Ray head did not listen on port {port}")


@contextlib.contextmanager
def two_node_cluster(cpus_per_node: int = 1, timeout: float = 180) -> Iterator[tuple[str, Path]]:
    """Yield the head's address (``127.0.0.1:PORT``) of a running two-node cluster and the file
    holding its auth token (what a user passes as ``RAY_AUTH_TOKEN_PATH``)."""
    tmp = Path(tempfile.mkdtemp(prefix="kvos-ray-"))
    port = free_port()
    token = tmp / "auth_token"  # token authentication, as Ray >= 2.59 does with a token at hand
    token.write_text(secrets.token_hex(32))
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("RAY_")},
           "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
    common = ["--num-cpus", str(cpus_per_node), "--num-gpus", "0"]
    procs = [_start(["--head", "--port", str(port), "--temp-dir", str(tmp / "ray"), "--include-dashboard", "false",
                     "--resources", '{"node_a": 1}', *common],
                    tmp / "head.log", env)]
    address = f"127.0.0.1:{port}"
    try:
        _wait_port(port, procs, timeout)
        procs.append(_start(["--address", address, "--resources", '{"node_b": 1}', *common], tmp / "node.log", env))
        _wait_nodes(address, 2, env, procs, timeout)
        yield address, token
    except BaseException:
        for log in ("head.log", "node.log"):
            if (tmp / log).exists():
                sys.stderr.write((tmp / log).read_text()[-3000:])
        raise
    finally:
        for p in reversed(procs):
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
        for p in reversed(procs):
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        shutil.rmtree(tmp, ignore_errors=True)
