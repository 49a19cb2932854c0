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
import os
import socket
import threading
import time
import traceback
from collections import deque
from concurrent.futures import Future
from multiprocessing.connection import Connection
from pathlib import Path

import torch
import torch.distributed as dist

from kvos.cache.layout import CacheLayout
from kvos.core.step import StepDescription
from kvos.models.loader import read_model_config
from kvos.models.tensor_parallel import TPGroup, check_tensor_parallel
from kvos.worker.device_rows import RankRows
from kvos.worker.peer_channel import PeerRows
from kvos.worker.runner import LaunchedStep, ModelRunner

COLLECTIVE_TIMEOUT_S = 600.0
"""How long a rank waits in one collective for the others (a dead rank fails the step then)."""
START_TIMEOUT_S = 600.0
"""How long rank 0 waits for a worker to load its shard."""

_REPLIES = ("profile_kv_budget", "read_rows", "share_blocks", "hold_blocks", "write_peer_rows")
"""Worker calls whose result rank 0 reads (in the order it asked); the others are
fire-and-forget (a failure ends the worker and fails rank 0's next call)."""


def _read_rows(runner: ModelRunner, block_ids: list[int], group: int | None):
    """A rank's part of the blocks as a numpy array (pickled to rank 0)."""
    return runner.read_blocks(block_ids, group=group).numpy()


def _write_rows(runner: ModelRunner, block_ids: list[int], part, group: int | None) -> None:
    runner.write_blocks(block_ids, torch.from_numpy(part), group=group)


def _write_peer_rows(runner: ModelRunner, block_ids: list[int], rows: PeerRows, positions: list[int],
                     part: int) -> str | None:
    """A rank's part of another engine's held rows written into its pool; the error's text
    instead of ending the worker (rank 0 then leaves the blocks uncached)."""
    try:
        runner.write_peer_rows(block_ids, rows, positions, part)
    except Exception as err:  # noqa: BLE001 - the sender's side failed, not this rank
        return f"rank {part}: {err}"
    return None


_RANK_CALLS = {"read_rows": _read_rows, "write_rows": _write_rows, "write_peer_rows": _write_peer_rows}
"""Worker calls that are not ``ModelRunner`` methods of the same name."""


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


def _exit_with_parent(parent: int) -> None:
    """End this worker once rank 0's process is gone (killed, or stuck and killed by its own
    parent): its pipe's end alone does not end a worker blocked in a collective or in NCCL's
    teardown, and an orphaned rank would hold its GPU and its parent's output streams."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(1)


def worker_main(conn: Connection, rank: int, size: int, init_method: str, model_path: Path, dtype: torch.dtype,
                device: torch.device, random_weights: bool, threads: int) -> None:
    """A worker process: its shard, then calls from rank 0 until ``shutdown`` (or the pipe closes).
    A failed call is sent back as ``("error", text)`` and ends the worker: its collectives can no
    longer match rank 0's."""
    torch.set_num_threads(threads)
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), name="kvos-tp-parent-watch", daemon=True).start()
    runner: ModelRunner | None = None
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
            call = _RANK_CALLS.get(method)
            result = call(runner, *args) if call is not None else getattr(runner, method)(*args)
            if method in _REPLIES:
                conn.send(("ok", result))
    except BaseException as e:  # noqa: BLE001 - reported to rank 0, which fails the engine
        try:
            conn.send(("error", (type(e).__name__, f"tensor-parallel rank {rank}: {e}", traceback.format_exc())))
        except OSError:
            pass
    finally:
        if dist.is_initialized():
            if runner is not None:
                runner.release_cuda_graphs()  # NCCL's teardown waits for graphs holding collectives
            dist.destroy_process_group()


class _RankLink:
    """Rank 0's pipe to one worker. Sends go under a lock (any thread); a reader thread hands each
    reply to the call that waits for it: the worker answers reply calls in the order they were
    sent. An error from the worker fails every waiting call and every later one."""

    def __init__(self, conn: Connection, proc) -> None:
        self.conn, self.proc = conn, proc
        self.lock = threading.Lock()
        self.waiting: deque[Future] = deque()
        self.error: BaseException | None = None
        self.reader: threading.Thread | None = None

    def start_reading(self) -> None:
        self.reader = threading.Thread(target=self._read, name=f"{self.proc.name}-replies", daemon=True)
        self.reader.start()

    def _read(self) -> None:
        while True:
            try:
                kind, value = self.conn.recv()
            except (EOFError, OSError):
                self._fail(RuntimeError(f"tensor parallelism: worker {self.proc.name} exited"))
                return
            if kind == "error":
                self._fail(_worker_error(value))
                return
            with self.lock:
                fut = self.waiting.popleft() if self.waiting else None
            if fut is not None:
                fut.set_result(value)

    def _fail(self, err: BaseException) -> None:
        with self.lock:
            self.error = self.error or err
            waiting, self.waiting = list(self.waiting), deque()
        for fut in waiting:
            fut.set_exception(err)

    def send(self, method: str, args: tuple) -> Future | None:
        """Queue ``method(*args)`` on the worker; a ``Future`` of its result for ``_REPLIES``."""
        with self.lock:
            if self.error is not None:
                raise self.error
            if not self.proc.is_alive():
                raise RuntimeError(f"tensor parallelism: worker {self.proc.name} exited (code {self.proc.exitcode})")
            fut: Future | None = Future() if method in _REPLIES else None
            if fut is not None:
                self.waiting.append(fut)
            self.conn.send((method, args))
        return fut


def _worker_error(value) -> BaseException:
    name, text, trace = value
    if name == "ValueError":  # bad input, as rank 0 would have raised it
        return ValueError(text)
    return RuntimeError(f"{text} ({name})\n{trace}")


class ParallelRunner(ModelRunner):
    """Rank 0 of ``size``: a ``ModelRunner`` over its shard that drives ranks 1.. (worker processes).

    Whole blocks (``read_blocks``/``write_blocks``: swap, KV hand-over) are rows of ``size``
    parts, rank r's part (its K/V heads) r-th: each rank reads or writes its own. Calls may come
    from any thread (a prefill engine reads its exports beside the steps); a worker runs them in
    the order rank 0 sent them, so a read sent after a step's launch sees that step's writes."""

    def __init__(self, size: int, model_path: Path, dtype: torch.dtype, device: torch.device,
                 random_weights: bool = False) -> None:
        if device.type == "cuda" and torch.cuda.device_count() < size:
            raise ValueError(f"tensor_parallel_size {size} needs {size} GPUs; {torch.cuda.device_count()} are visible")
        if dist.is_initialized():
            raise ValueError(f"tensor_parallel_size {size}: this process already has a process group (another "
                             f"tensor-parallel engine?); shut it down first (LLM.shutdown)")
        check_tensor_parallel(read_model_config(model_path, random_weights), size)  # before any process starts
        self.size = size
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        ctx = mp.get_context("spawn")
        self._links: list[_RankLink] = []
        for rank in range(1, size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=worker_main, name=f"kvos-tp-rank{rank}", daemon=True,
                               args=(child, rank, size, init_method, model_path, dtype, device, random_weights,
                                     torch.get_num_threads()))
            proc.start()
            child.close()
            self._links.append(_RankLink(parent, proc))
        try:
            dev = _rank_device(device, 0)
            if dev.type == "cuda":
                torch.cuda.set_device(dev)
            super().__init__(model_path, dtype, dev, random_weights=random_weights, tp=TPGroup(0, size))
            for link in self._links:  # every shard loaded (or its error raised here) before the group forms
                self._ready(link)
                link.start_reading()
            _init_group("nccl" if dev.type == "cuda" else "gloo", init_method, 0, size, dev)
        except BaseException:
            self.shutdown()
            raise

    @staticmethod
    def _ready(link: _RankLink) -> None:
        if not link.conn.poll(START_TIMEOUT_S):
            raise RuntimeError(f"tensor parallelism: a worker did not load its shard within {START_TIMEOUT_S:.0f} s")
        try:
            kind, value = link.conn.recv()
        except EOFError:
            raise RuntimeError("tensor parallelism: a worker process exited") from None
        if kind == "error":
            raise _worker_error(value)

    def _send(self, method: str, *args) -> list[Future | None]:
        return [link.send(method, args) for link in self._links]

    def _send_each(self, method: str, per_rank: list[tuple]) -> list[Future | None]:
        """``method`` with worker r's own arguments ``per_rank[r - 1]``."""
        return [link.send(method, args) for link, args in zip(self._links, per_rank)]

    @torch.inference_mode()
    def profile_kv_budget(self, gpu_memory_utilization: float, max_num_batched_tokens: int) -> int:
        """The smallest of the ranks' budgets: every rank's pool has as many pages."""
        replies = self._send("profile_kv_budget", gpu_memory_utilization, max_num_batched_tokens)
        mine = super().profile_kv_budget(gpu_memory_utilization, max_num_batched_tokens)
        return min([mine, *(f.result(START_TIMEOUT_S) for f in replies)])

    def allocate_kv_cache(self, layout: CacheLayout, num_pages: int) -> None:
        self._send("allocate_kv_cache", layout, num_pages)
        super().allocate_kv_cache(layout, num_pages)

    def capture_cuda_graphs(self, max_num_seqs: int, max_model_len: int, max_context: int = 8192,
                            mixed_tokens: int = 0) -> None:
        self._send("capture_cuda_graphs", max_num_seqs, max_model_len, max_context, mixed_tokens)
        super().capture_cuda_graphs(max_num_seqs, max_model_len, max_context, mixed_tokens)

    def time_all_reduce(self, rows: int, reps: int = 20) -> float:
        self._send("time_all_reduce", rows, reps)
        return super().time_all_reduce(rows, reps)

    @torch.inference_mode()
    def launch(self, step: StepDescription, defer_sampling: bool = False) -> LaunchedStep:
        self._send("launch", step, defer_sampling)
        return super().launch(step, defer_sampling)

    # -- whole blocks: ``size`` parts per row -----------------------------------------------
    @property
    def block_bytes(self) -> int:
        return super().block_bytes * self.size

    def group_block_bytes(self, group: int) -> int:
        return super().group_block_bytes(group) * self.size

    def read_blocks(self, block_ids: list[int], digests_out: list[int] | None = None,
                    group: int | None = None) -> torch.Tensor:
        """Every rank's part of the blocks, side by side in each host row."""
        if digests_out is not None:
            raise NotImplementedError("tensor parallelism: block digests (CPU tier frames) are per rank")
        replies = self._send("read_rows", block_ids, group)
        mine = super().read_blocks(block_ids, group=group)
        return torch.cat([mine, *(torch.from_numpy(f.result(COLLECTIVE_TIMEOUT_S)) for f in replies)], dim=1)

    def write_blocks(self, block_ids: list[int], rows: torch.Tensor, group: int | None = None) -> None:
        """Each rank writes its part of ``rows`` (``read_blocks``' layout)."""
        if rows.shape[1] % self.size:
            raise ValueError(f"block rows of {rows.shape[1]} bytes do not split over {self.size} ranks")
        parts = rows.cpu().chunk(self.size, dim=1)
        self._send_each("write_rows", [(block_ids, p.contiguous().numpy(), group) for p in parts[1:]])
        self._write_pages(block_ids, parts[0].contiguous(), group)

    def share_blocks(self, block_ids: list[int]) -> RankRows:
        """Each rank's part of the blocks, shared from its own GPU (``ModelRunner.share_blocks``)."""
        replies = self._send("share_blocks", block_ids)
        mine = super().share_blocks(block_ids)
        return RankRows([mine, *(f.result(COLLECTIVE_TIMEOUT_S) for f in replies)])

    def write_shared_rows(self, block_ids: list[int], rows, positions: list[int]) -> None:
        """``rows``: ``RankRows`` of a sender with as many ranks; rank r copies part r."""
        if not isinstance(rows, RankRows) or len(rows.parts) != self.size:
            raise ValueError(f"tensor parallelism: rows shared by another engine's ranks must come in "
                             f"{self.size} parts (the same tensor_parallel_size on both sides)")
        self._send_each("write_shared_rows", [(block_ids, p, positions) for p in rows.parts[1:]])
        super().write_shared_rows(block_ids, rows.parts[0], positions)

    def hold_blocks(self, block_ids: list[int]) -> PeerRows:
        """Each rank's part of the blocks, held on its own device for the receiver's rank of the
        same index (``ModelRunner.hold_blocks``)."""
        replies = self._send("hold_blocks", block_ids)
        parts = [super().hold_blocks(block_ids), *(f.result(COLLECTIVE_TIMEOUT_S) for f in replies)]
        return PeerRows([p.addresses[0] for p in parts], [p.tickets[0] for p in parts], parts[0].rows,
                        parts[0].part_bytes)

    def write_peer_rows(self, block_ids: list[int], rows: PeerRows, positions: list[int], part: int = 0) -> None:
        """Rank r pulls part r of ``rows`` (a sender with as many ranks) and writes it; raises
        (after every rank is done) if any rank failed, so the caller leaves the blocks uncached."""
        if len(rows.tickets) != self.size:
            raise ValueError(f"tensor parallelism: rows held by another engine's ranks must come in "
                             f"{self.size} parts (the same tensor_parallel_size on both sides)")
        replies = self._send_each("write_peer_rows", [(block_ids, rows, positions, r) for r in range(1, self.size)])
        errors = []
        try:
            super().write_peer_rows(block_ids, rows, positions, 0)
        except Exception as err:  # noqa: BLE001 - reported after the other ranks answered
            errors.append(f"rank 0: {err}")
        errors += [e for e in (f.result(COLLECTIVE_TIMEOUT_S) for f in replies) if e]
        if errors:
            raise RuntimeError("p2p: " + "; ".join(errors))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the workers (reaped, killed after ``timeout``) and leave the process group, rank 0
        while the workers leave theirs. Every rank drops its CUDA graphs first: graphs that
        captured NCCL collectives hold references on the communicator, and NCCL's teardown
        waits for them (it never ended with the graphs alive). A teardown that still does not
        end within ``timeout`` is given up, and the process keeps its group (no other
        tensor-parallel engine can start in it)."""
        for link in self._links:
            try:
                link.conn.send(("shutdown", ()))
            except OSError:
                pass
        if dist.is_initialized():
            self.release_cuda_graphs()
            leave = threading.Thread(target=dist.destroy_process_group, name="kvos-tp-leave", daemon=True)
            leave.start()
            leave.join(timeout)
        for link in self._links:
            link.proc.join(timeout)
            if link.proc.is_alive():
                link.proc.kill()
                link.proc.join()
        self._links = []

    def __del__(self) -> None:
        if getattr(self, "_links", None):
            self.shutdown(1.0)
