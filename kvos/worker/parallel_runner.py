"""A tensor-parallel engine's runner: rank 0 in the engine's process, ranks 1.. in worker processes.

Rank 0 (``ParallelRunner``) is the engine's ``ModelRunner``; each call that touches the model or
the pool (profiling, allocation, graph capture, ``launch``) is first sent to the workers over a
pipe as plain data (the ``StepDescription`` for a step), then run here. Each worker runs the same
call on its own ``ModelRunner`` shard, so the collectives inside match rank for rank. The
scheduler and the memory system stay with rank 0: workers only ever see step descriptions.

Ranks talk through ``torch.distributed``: NCCL on CUDA GPUs (rank r on ``cuda:r``), gloo on the
CPU. One tensor-parallel engine per process (it owns the default process group until
``shutdown``).
"""
from __future__ import annotations

import datetime
import multiprocessing as mp
import socket
import traceback
from multiprocessing.connection import Connection
from pathlib import Path

import torch
import torch.distributed as dist

from kvos.cache.layout import CacheLayout
from kvos.core.step import StepDescription
from kvos.models.loader import read_model_config
from kvos.models.tensor_parallel import TPGroup, check_tensor_parallel
from kvos.worker.runner import LaunchedStep, ModelRunner

COLLECTIVE_TIMEOUT_S = 600.0
"""How long a rank waits in one collective for the others (a dead rank fails the step then)."""
START_TIMEOUT_S = 600.0
"""How long rank 0 waits for a worker to load its shard."""

_REPLIES = ("profile_kv_budget",)
"""Worker calls whose result rank 0 reads; the others are fire-and-forget (a failure is read
before the next call)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_group(backend: str, init_method: str, rank: int, size: int, device: torch.device) -> None:
    """Join the default process group (the ``TPGroup``'s collectives run in it)."""
    kwargs = {"device_id": device} if backend == "nccl" else {}
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S), **kwargs)


def _rank_device(device: torch.device, rank: int) -> torch.device:
    return torch.device("cuda", rank) if device.type == "cuda" else device


def worker_main(conn: Connection, rank: int, size: int, init_method: str, model_path: Path, dtype: torch.dtype,
                device: torch.device, random_weights: bool, threads: int) -> None:
    """A worker process: its shard, then calls from rank 0 until ``shutdown`` (or the pipe closes).
    A failed call is sent back as ``("error", text)`` and ends the worker: its collectives can no
    longer match rank 0's."""
    torch.set_num_threads(threads)
    try:
        dev = _rank_device(device, rank)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        runner = ModelRunner(model_path, dtype, dev, random_weights=random_weights, tp=TPGroup(rank, size))
        conn.send(("ready", None))  # the shard is loaded; its collectives need the group from here on
        _init_group("nccl" if dev.type == "cuda" else "gloo", init_method, rank, size, dev)
        while True:
            try:
                method, args = conn.recv()
            except EOFError:
                return
            if method == "shutdown":
                return
            result = getattr(runner, method)(*args)
            if method in _REPLIES:
                conn.send(("ok", result))
    except BaseException as e:  # noqa: BLE001 - reported to rank 0, which fails the engine
        try:
            conn.send(("error", (type(e).__name__, f"tensor-parallel rank {rank}: {e}", traceback.format_exc())))
        except OSError:
            pass
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class ParallelRunner(ModelRunner):
    """Rank 0 of ``size``: a ``ModelRunner`` over its shard that drives ranks 1.. (worker processes).

    Reading or writing whole blocks (tiers, swap, KV transfer) is not supported: a block's bytes
    are spread over the ranks. The engine refuses those settings with tensor parallelism."""

    def __init__(self, size: int, model_path: Path, dtype: torch.dtype, device: torch.device,
                 random_weights: bool = False) -> None:
        if device.type == "cuda" and torch.cuda.device_count() < size:
            raise ValueError(f"tensor_parallel_size {size} needs {size} GPUs; {torch.cuda.device_count()} are visible")
        if dist.is_initialized():
            raise ValueError(f"tensor_parallel_size {size}: this process already has a process group (another "
                             f"tensor-parallel engine?); shut it down first (LLM.shutdown)")
        check_tensor_parallel(read_model_config(model_path, random_weights), size)  # before any process starts
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        ctx = mp.get_context("spawn")
        self._conns: list[Connection] = []
        self._procs: list = []
        for rank in range(1, size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=worker_main, name=f"kvos-tp-rank{rank}", daemon=True,
                               args=(child, rank, size, init_method, model_path, dtype, device, random_weights,
                                     torch.get_num_threads()))
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        try:
            dev = _rank_device(device, 0)
            if dev.type == "cuda":
                torch.cuda.set_device(dev)
            super().__init__(model_path, dtype, dev, random_weights=random_weights, tp=TPGroup(0, size))
            for conn in self._conns:  # every shard loaded (or its error raised here) before the group forms
                self._reply(conn, START_TIMEOUT_S, "ready")
            _init_group("nccl" if dev.type == "cuda" else "gloo", init_method, 0, size, dev)
        except BaseException:
            self.shutdown()
            raise

    def _reply(self, conn: Connection, timeout: float | None = None, expect: str = "ok"):
        if timeout is not None and not conn.poll(timeout):
            raise RuntimeError(f"tensor parallelism: a worker did not answer within {timeout:.0f} s")
        try:
            kind, value = conn.recv()
        except EOFError:
            raise RuntimeError("tensor parallelism: a worker process exited") from None
        if kind == "error":
            name, text, trace = value
            if name == "ValueError":  # bad input, as rank 0 would have raised it
                raise ValueError(text)
            raise RuntimeError(f"{text} ({name})\n{trace}")
        assert kind == expect, (kind, expect)
        return value

    def _send(self, method: str, *args) -> None:
        for conn, proc in zip(self._conns, self._procs):
            if conn.poll():  # only an error arrives unasked
                self._reply(conn)
            if not proc.is_alive():
                raise RuntimeError(f"tensor parallelism: worker {proc.name} exited (code {proc.exitcode})")
            conn.send((method, args))

    @torch.inference_mode()
    def profile_kv_budget(self, gpu_memory_utilization: float, max_num_batched_tokens: int) -> int:
        """The smallest of the ranks' budgets: every rank's pool has as many pages."""
        self._send("profile_kv_budget", gpu_memory_utilization, max_num_batched_tokens)
        mine = super().profile_kv_budget(gpu_memory_utilization, max_num_batched_tokens)
        return min([mine, *(self._reply(c) for c in self._conns)])

    def allocate_kv_cache(self, layout: CacheLayout, num_pages: int) -> None:
        self._send("allocate_kv_cache", layout, num_pages)
        super().allocate_kv_cache(layout, num_pages)

    def capture_decode_graphs(self, max_num_seqs: int, max_model_len: int, max_context: int = 8192) -> None:
        self._send("capture_decode_graphs", max_num_seqs, max_model_len, max_context)
        super().capture_decode_graphs(max_num_seqs, max_model_len, max_context)

    def time_all_reduce(self, rows: int, reps: int = 20) -> float:
        self._send("time_all_reduce", rows, reps)
        return super().time_all_reduce(rows, reps)

    @torch.inference_mode()
    def launch(self, step: StepDescription, defer_sampling: bool = False) -> LaunchedStep:
        self._send("launch", step, defer_sampling)
        return super().launch(step, defer_sampling)

    def read_blocks(self, *args, **kwargs):
        raise NotImplementedError("tensor parallelism: a block's bytes are spread over the ranks")

    write_blocks = gather_blocks = read_blocks

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the workers (reaped, killed after ``timeout``) and leave the process group."""
        for conn in self._conns:
            try:
                conn.send(("shutdown", ()))
            except OSError:
                pass
        for proc in self._procs:
            proc.join(timeout)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self._procs, self._conns = [], []
        if dist.is_initialized():
            dist.destroy_process_group()

    def __del__(self) -> None:
        if getattr(self, "_procs", None):
            self.shutdown(1.0)
