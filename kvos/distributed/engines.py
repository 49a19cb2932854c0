"""Where the engines of a front end run: Ray actors, or plain local processes (no Ray).

Both hold ``EngineWorker``s and expose one contract to ``DataParallelEngine``: ``call(i, method,
*args)`` runs ``EngineWorker.method`` on engine ``i`` and is awaited for its result; a dead
engine raises ``EngineDied``; ``revive(i)`` returns True once engine ``i`` answers again (Ray
restarts actors itself; local processes are started anew here).
"""
from __future__ import annotations

import asyncio
import atexit
import contextlib
import itertools
import logging
import multiprocessing as mp
import os
import threading
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from typing import Any

log = logging.getLogger("kvos.distributed")

TRANSPORTS = ("ray", "process")

RPC_THREADS = 64
"""Calls one engine answers at once. An ``add`` waits for the engine's next step boundary, so a
burst of requests needs about as many (with 8, on 2 H200s, a prefill/decode hand-over took
185-199 ms against 119 ms with 64)."""


class EngineDied(RuntimeError):
    """The engine's process or actor is gone; its calls in flight fail with this."""


class EngineHung(EngineDied):
    """The engine did not answer a call within its deadline (a stopped or stuck process); it is
    routed around like a dead one until it answers again."""


class RayEngines:
    """One ``EngineWorker`` actor per engine on the Ray cluster at ``address`` (None: start a
    local one, or join the one ``RAY_ADDRESS`` names; ``kvos.distributed.ray_cluster.join``).
    Each engine is placed in a bundle of one placement group, spread over the nodes
    (``ray_cluster.place_engines``): with GPUs, ``tensor_parallel_size`` GPUs of one node per
    engine, whose ranks the actor starts as its own processes there. Ray restarts a dead actor
    (in its bundle) up to ``max_restarts`` times."""

    device_transfer = False
    """Actors see only their own GPUs: KV between them travels as host rows (the object store)."""

    def __init__(self, kwargs: list[dict], address: str | None, max_restarts: int) -> None:
        import ray

        from kvos.distributed import ray_cluster

        self._started_ray = ray_cluster.join(address, {"TOKENIZERS_PARALLELISM": "false"})
        n = len(kwargs)
        tp = max(k.get("tensor_parallel_size", 1) for k in kwargs)
        resources = ray.cluster_resources()
        on_cpu = all(k.get("device", "auto") == "cpu" for k in kwargs)
        self._gpus = tp if not on_cpu and resources.get("GPU", 0) >= n * tp else 0
        if tp > 1 and not on_cpu and resources.get("GPU", 0) and not self._gpus:
            raise ValueError(f"tensor_parallel_size {tp}: {n} engine(s) need {n * tp} GPUs; the Ray cluster has "
                             f"{resources.get('GPU', 0):.0f}")
        self._threads = max(1, int(resources.get("CPU", 1) // (n * tp)))
        self._max_restarts = max_restarts
        self._groups: list = []
        self._place: list[tuple] = []  # engine i: (placement group, bundle index)
        try:
            pg = ray_cluster.place_engines(n, self._gpus)
            self._groups.append(pg)
            self._place = [(pg, i) for i in range(n)]
            self.actors = [self._start(kwargs[i], i) for i in range(n)]
        except BaseException:
            self.shutdown()
            raise

    def _start(self, kwargs: dict, i: int):
        import ray

        from kvos.distributed.ray_cluster import BUNDLE_CPUS, in_bundle

        cls, kwargs = worker_class(kwargs)
        pg, bundle = self._place[i]
        return ray.remote(cls).options(
            num_cpus=BUNDLE_CPUS, num_gpus=self._gpus, max_restarts=self._max_restarts,
            max_concurrency=RPC_THREADS, scheduling_strategy=in_bundle(pg, bundle)).remote(kwargs, i, self._threads)

    def add_engine(self, kwargs: dict) -> int:
        """Start one more engine actor in a placement group of its own; returns its index."""
        from kvos.distributed.ray_cluster import place_engines

        pg = place_engines(1, self._gpus)
        self._groups.append(pg)
        self._place.append((pg, 0))
        self.actors.append(self._start(kwargs, len(self.actors)))
        return len(self.actors) - 1

    def stop_engine(self, i: int) -> None:
        """End engine ``i``'s actor for good (no restart)."""
        import ray

        ray.kill(self.actors[i], no_restart=True)

    def restarts_left(self, i: int) -> int | None:
        """Unknown here: Ray counts an actor's restarts."""
        return None

    def __len__(self) -> int:
        return len(self.actors)

    def call_sync(self, i: int, method: str, *args) -> Any:
        import ray

        return ray.get(getattr(self.actors[i], method).remote(*args))

    async def call(self, i: int, method: str, *args) -> Any:
        from ray.exceptions import RayActorError

        try:
            return await getattr(self.actors[i], method).remote(*args)
        except RayActorError as err:
            raise EngineDied(f"engine {i}: {err}") from err

    def notify(self, i: int, method: str, *args) -> None:
        """Fire and forget (abort)."""
        getattr(self.actors[i], method).remote(*args)

    async def revive(self, i: int) -> bool:
        try:
            await asyncio.wait_for(self.call(i, "ping"), timeout=5)
            return True
        except Exception:
            return False

    def shutdown(self) -> None:
        import ray

        from kvos.distributed.ray_cluster import remove

        if not ray.is_initialized():
            return
        for a in getattr(self, "actors", []):
            ray.kill(a, no_restart=True)
        for pg in self._groups:
            with contextlib.suppress(Exception):
                remove(pg)
        self._groups = []
        if self._started_ray:
            ray.shutdown()


def worker_class(kwargs: dict) -> tuple[type, dict]:
    """The worker an engine's keywords ask for (``role``: ``"encoder"`` for an
    ``EncoderWorker``, else an ``EngineWorker``) and the keywords it takes."""
    rest = {k: v for k, v in kwargs.items() if k != "role"}
    if kwargs.get("role") == "encoder":
        from kvos.distributed.encoder_worker import EncoderWorker

        return EncoderWorker, rest
    from kvos.distributed.worker import EngineWorker

    return EngineWorker, rest


def _serve_engine(conn, kwargs: dict, index: int, threads: int, gpu: str | None, log_level: int) -> None:
    """An engine process: build the ``EngineWorker``, then answer calls until the pipe closes.
    Calls run on a pool of threads (a ``poll`` waits for news while an ``add`` goes through);
    replies share the pipe under a lock."""
    if gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cls, kwargs = worker_class(kwargs)
        worker = cls(kwargs, index, threads)
    except BaseException as err:  # the parent's start-up call sees it
        conn.send((0, False, RuntimeError(f"engine {index} failed to start: {err!r}")))
        return
    conn.send((0, True, None))
    lock = threading.Lock()
    pool = ThreadPoolExecutor(RPC_THREADS, thread_name_prefix=f"kvos-engine-{index}-rpc")

    def run(call_id: int, method: str, args: tuple) -> None:
        try:
            reply = (call_id, True, getattr(worker, method)(*args))
        except BaseException as err:
            reply = (call_id, False, err)
        try:
            with lock:
                conn.send(reply)
        except (OSError, ValueError):
            pass  # the parent is gone
        except Exception as err:  # an unpicklable result or error
            with lock:
                conn.send((call_id, False, RuntimeError(f"{method}: {err!r}")))

    while True:
        try:
            call_id, method, args = conn.recv()
        except (EOFError, OSError):
            break
        if method is None:  # ``_Process.stop``
            break
        pool.submit(run, call_id, method, args)
    worker.shutdown()
    os._exit(0)


class _Process:
    """One engine process and its pipe; ``reader`` resolves the futures of calls in flight."""

    def __init__(self, ctx, kwargs: dict, index: int, threads: int, gpu: str | None, daemon: bool = True) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve_engine, args=(child, kwargs, index, threads, gpu,
                                                            logging.getLogger().getEffectiveLevel()),
                                name=f"kvos-engine-{index}", daemon=daemon)
        self.proc.start()
        child.close()
        self.index = index
        self.lock = threading.Lock()
        self.pending: dict[int, Future] = {}
        self.ids = itertools.count(1)
        self.alive = True
        self.pending_start: Future = Future()
        self.pending[0] = self.pending_start
        self.reader = threading.Thread(target=self._read, name=f"kvos-engine-{index}-reader", daemon=True)
        self.reader.start()

    def wait_started(self) -> None:
        """Block until the engine is built; raises if it failed to start."""
        self.pending_start.result()

    def call(self, method: str, args: tuple) -> Future:
        fut: Future = Future()
        with self.lock:
            if not self.alive:
                fut.set_exception(EngineDied(f"engine {self.index} is down"))
                return fut
            call_id = next(self.ids)
            self.pending[call_id] = fut
            try:
                self.conn.send((call_id, method, args))
            except (OSError, ValueError) as err:
                del self.pending[call_id]
                fut.set_exception(EngineDied(f"engine {self.index}: {err}"))
        return fut

    def _read(self) -> None:
        while True:
            try:
                call_id, ok, value = self.conn.recv()
            except (EOFError, OSError, TypeError):  # (TypeError: closed by ``stop`` meanwhile)
                break
            with self.lock:
                fut = self.pending.pop(call_id, None)
            if fut is not None:
                with contextlib.suppress(InvalidStateError):  # a caller cancelled it
                    fut.set_result(value) if ok else fut.set_exception(value)
        with self.lock:
            self.alive = False
            pending, self.pending = self.pending, {}
        for fut in pending.values():
            with contextlib.suppress(InvalidStateError):
                fut.set_exception(EngineDied(f"engine {self.index} exited (code {self.proc.exitcode})"))

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the engine process to shut down and wait up to ``timeout`` for it, then kill it.
        (Closing the pipe alone would not reach the child while ``reader`` is blocked reading
        it: the socket stays open until that read returns.)"""
        with self.lock, contextlib.suppress(OSError, ValueError):
            self.conn.send((0, None, ()))
        self.proc.join(timeout)
        if self.proc.is_alive():
            log.warning("engine %d did not stop within %.0f s; killed", self.index, timeout)
            self.proc.kill()
            self.proc.join(timeout)
        with contextlib.suppress(OSError):
            self.conn.close()


class ProcessEngines:
    """One ``EngineWorker`` per local process (``spawn``), no Ray: ``kvos serve --transport
    process``. With a GPU per engine, engine ``i``'s device is GPU ``i`` (first in its
    ``CUDA_VISIBLE_DEVICES``; the others stay visible for CUDA IPC).
    A dead process is started anew by ``revive``, up to ``max_restarts`` times per engine.
    ``gpu_offset`` (encoder engines beside language engines): engine ``i`` takes GPU
    ``(gpu_offset + i) % GPUs``, sharing a GPU when there are fewer."""

    def __init__(self, kwargs: list[dict], max_restarts: int, gpu_offset: int | None = None) -> None:
        n = len(kwargs)
        self._ctx = mp.get_context("spawn")
        self._kwargs = kwargs
        gpus = _visible_gpus() if any(k.get("device", "auto") != "cpu" for k in kwargs) else []
        # engine i's own GPU first (its "cuda"), the others after it: visible, so that CUDA IPC
        # handles of another engine's memory open there (disaggregated prefill)
        tp = max(k.get("tensor_parallel_size", 1) for k in kwargs)
        if gpu_offset is not None and gpus:
            rot = [(gpu_offset + i) % len(gpus) for i in range(n)]
            self._gpu = [",".join(gpus[r:] + gpus[:r]) for r in rot]
        elif tp > 1 and gpus and len(gpus) < n * tp:  # engines share GPUs: engine i's rank r on GPU (i + r) % G
            if len(gpus) < tp:
                raise ValueError(f"tensor_parallel_size {tp}: {len(gpus)} GPUs are visible")
            log.warning("%d engines of %d ranks share %d GPUs: give each a gpu_memory_utilization share", n, tp,
                        len(gpus))
            self._gpu = [",".join(gpus[i % len(gpus):] + gpus[:i % len(gpus)]) for i in range(n)]
        else:  # engine i's ranks on GPUs i*tp .. i*tp + tp - 1
            self._gpu = [",".join(gpus[i * tp:] + gpus[:i * tp]) if len(gpus) >= n * tp else None for i in range(n)]
        self._daemon = tp == 1
        """A tensor-parallel engine starts its ranks as processes of its own, which a daemonic
        process may not; such engines end when their pipe closes (the front end gone)."""
        self.device_transfer = bool(gpus)
        """The engines are processes of this host on its GPUs: KV moves between them by CUDA IPC."""
        self._threads = max(1, (os.cpu_count() or 1) // (n * tp))
        self._max_restarts = max_restarts
        self._restarts = [max_restarts] * n
        self.procs = [_Process(self._ctx, kwargs[i], i, self._threads, self._gpu[i], self._daemon) for i in range(n)]
        if not self._daemon:  # at exit, before multiprocessing joins its non-daemonic children (which
            # wait for their pipe to close): stop them
            atexit.register(self.shutdown)
        try:  # built side by side
            for p in self.procs:
                p.wait_started()
        except BaseException:
            self.shutdown()
            raise

    def __len__(self) -> int:
        return len(self.procs)

    def call_sync(self, i: int, method: str, *args) -> Any:
        return self.procs[i].call(method, args).result()

    async def call(self, i: int, method: str, *args) -> Any:
        return await asyncio.wrap_future(self.procs[i].call(method, args))

    def notify(self, i: int, method: str, *args) -> None:
        self.procs[i].call(method, args)

    async def revive(self, i: int) -> bool:
        """True once engine ``i``'s process is running (a dead one started anew, while restarts are
        left; past them, the dead process is reaped and this stays False)."""
        p = self.procs[i]
        if p.alive:
            return True
        if self._restarts[i] <= 0:
            if p.proc.exitcode is None:
                await asyncio.to_thread(p.stop, 1.0)  # reap it
            await asyncio.sleep(1.0)
            return False
        self._restarts[i] -= 1
        p.stop(1.0)
        try:
            new = await asyncio.to_thread(_Process, self._ctx, self._kwargs[i], i, self._threads, self._gpu[i],
                                          self._daemon)
            await asyncio.to_thread(new.wait_started)
            self.procs[i] = new
        except Exception:
            log.exception("engine %d: restart failed", i)
            return False
        return True

    def kill(self, i: int) -> None:
        """Kill engine ``i``'s process (fault injection for tests)."""
        self.procs[i].proc.kill()

    def restarts_left(self, i: int) -> int | None:
        return self._restarts[i]

    def add_engine(self, kwargs: dict) -> int:
        """Start one more engine process (blocks until it is built); returns its index."""
        i = len(self.procs)
        proc = _Process(self._ctx, kwargs, i, self._threads, None, self._daemon)
        proc.wait_started()
        self._kwargs.append(kwargs)
        self._gpu.append(None)
        self._restarts.append(self._max_restarts)
        self.procs.append(proc)
        return i

    def stop_engine(self, i: int) -> None:
        """Stop engine ``i``'s process for good (no restart)."""
        self._restarts[i] = 0
        self.procs[i].stop()

    def shutdown(self) -> None:
        for p in self.procs:
            p.stop()


def _visible_gpus() -> list[str]:
    """The GPUs this process may use, as ``CUDA_VISIBLE_DEVICES`` names them, without
    initialising CUDA here (the children do)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d.strip() for d in visible.split(",") if d.strip()]
    try:
        import torch

        return [str(i) for i in range(torch.cuda.device_count())]
    except Exception:
        return []
