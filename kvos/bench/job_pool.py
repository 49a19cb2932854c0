"""Where a benchmark's independent simulator jobs run: in this process for one job at a time,
else in fresh (spawned) worker processes.

Workers are spawned, never forked: a fork copies the caller's address space, and a caller that
already holds a model (a test worker, a notebook) hands every child its pages and its torch
threads. On a machine short of memory the kernel then kills the children, not the caller."""
from __future__ import annotations

import multiprocessing
from concurrent.futures import Executor, Future, ProcessPoolExecutor
from typing import Any, Callable


class InlineExecutor(Executor):
    """Runs each submitted call at once in the calling thread; its futures are already done."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        fut: Future = Future()
        try:
            fut.set_result(fn(*args, **kwargs))
        except BaseException as e:  # the caller sees it from fut.result(), as from a pool
            fut.set_exception(e)
        return fut


def job_pool(jobs: int) -> Executor:
    """An executor for ``jobs`` parallel jobs: inline for ``jobs <= 1``, else spawned processes
    (the job functions must be importable module-level functions)."""
    if jobs <= 1:
        return InlineExecutor()
    return ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn"))
