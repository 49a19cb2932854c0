"""Runs an LLMEngine on its own thread and hands results to asyncio tasks: the in-process
``EngineClient`` (``kvos.engine.client``)."""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from kvos.cache.pins import PinInfo
from kvos.core.outputs import RequestOutput
from kvos.core.sampling_params import SamplingParams
from kvos.engine.client import (
    EngineHealth,
    EngineStopped,
    ModelFacts,
    OutputChannel,
    RequestStream,
)
from kvos.engine.llm_engine import LLMEngine

log = logging.getLogger("kvos.serve")
T = TypeVar("T")


class AsyncEngine:
    """The ``EngineClient`` of one ``LLMEngine`` in this process. Owns the engine thread; every
    engine call that changes it happens on that thread (``stats`` only reads).

    Commands (add, abort) are queued and applied between steps, so a step never sees a half-added
    request. An exception in a step fails the requests of that step and the engine goes on.
    A ``RequestStream`` aborts its request when the consumer stops iterating (client disconnect).
    """

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, OutputChannel] = {}
        self._stop = False
        self._closed: str | None = None  # set by cut_all: why new requests are refused
        self._thread = threading.Thread(target=self._run, name="kvos-engine", daemon=True)
        self.num_pending = 0  # sequences submitted with no output yet (event-loop thread only)
        self._queued = 0  # sequences submitted that the engine thread has not taken yet (under _queued_lock)
        self._queued_lock = threading.Lock()
        config = engine.config
        self.tokenizer = engine.tokenizer
        self.model_facts = ModelFacts(engine.kv.model_id, engine.max_model_len, engine.model_config.vocab_size,
                                      config.dtype, config.device, dict(engine.default_sampling),
                                      config.segment_reuse, engine.model_config.vision,
                                      engine.model_path if engine.model_path.is_dir() else None,
                                      engine.media.limits if engine.media is not None else None)

    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.engine.shutdown()

    async def submit(self, prompt, params: SamplingParams, request_id: str, priority: int = 0,
                     cache_salt: str | None = None, retriable: bool = False) -> RequestStream:
        """Queue a request; returns once the engine accepted it. Raises ``ValueError`` (naming
        the field) if the engine rejects it. ``retriable`` (may restart elsewhere) means nothing
        with one engine."""
        if self._closed is not None:
            raise EngineStopped(self._closed)
        loop = asyncio.get_running_loop()
        stream = OutputChannel(loop)
        accepted = loop.create_future()
        with self._queued_lock:
            self._queued += params.n
        self._submit(("add", (prompt, params, request_id, priority, cache_salt), stream, accepted))
        self.num_pending += params.n  # every sequence counts (a prompt forks into n)
        try:
            await accepted
        except BaseException:
            self.num_pending -= params.n
            self.abort(request_id)  # covers cancellation after the engine already took it
            raise
        return RequestStream(self, request_id, stream, params.n)

    def abort(self, request_id: str) -> None:
        self._submit(("abort", request_id, None, None))

    async def pin(self, prompt, ttl_s: float | None, cache_salt: str | None) -> PinInfo:
        """Compute and pin a prefix on the engine thread. Raises ``ValueError`` (naming the
        field) if the engine refuses it."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def on_done(result) -> None:
            if isinstance(result, Exception):
                loop.call_soon_threadsafe(_settle, done, result)
            else:
                loop.call_soon_threadsafe(_resolve, done, PinInfo.of(result, time.monotonic()))

        accepted = loop.create_future()
        self._submit(("pin", (prompt, ttl_s, cache_salt, on_done), OutputChannel(loop), accepted))
        await accepted
        return await done

    async def list_pins(self, pin_ids: set[str]) -> list[PinInfo]:
        """The live pins among ``pin_ids``."""
        return await self.call(lambda: self.engine.pin_infos(pin_ids))

    async def unpin(self, pin_id: str) -> bool:
        """Release a pin; False if there is none."""
        return await self.call(lambda: self.engine.unpin_prefix(pin_id))

    async def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the engine thread between steps; returns its result."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._submit(("call", fn, OutputChannel(loop), done))
        return await done

    @property
    def num_queued(self) -> int:
        """Sequences submitted that the engine thread has not taken yet. The engine thread lowers
        it before the scheduler holds them, so ``stats()["waiting"]`` read first and this read
        second never count a sequence twice (a reader may briefly miss one in between)."""
        return self._queued

    @property
    def num_in_flight(self) -> int:
        """Requests accepted and not finished (read from any thread; approximate)."""
        return len(self._streams)

    def stats(self) -> dict:
        """``LLMEngine.stats``, read from the event loop while the engine thread runs (counters
        and sizes: each figure is current, not all of them of the same step)."""
        return self.engine.stats()

    async def top_prefixes(self, n: int = 10) -> list[dict]:
        """``LLMEngine.top_prefixes``, on the engine thread between steps (it scans the cache)."""
        return await self.call(lambda: self.engine.top_prefixes(n))

    def health(self) -> EngineHealth:
        """One engine, in this process: serving while the server is."""
        return EngineHealth()

    async def drain(self, timeout: float) -> None:
        """Wait until no request is in flight, or ``timeout`` seconds (graceful shutdown)."""
        end = time.monotonic() + timeout
        while self._streams and time.monotonic() < end:
            await asyncio.sleep(0.05)

    async def cut_all(self, reason: str) -> int:
        """Abort every request in flight: each stream raises ``EngineStopped(reason)``, and every
        later ``submit`` does too. Returns how many were cut."""
        self._closed = reason

        def cut() -> int:
            n = len(self._streams)
            self._fail_all(EngineStopped(reason))
            return n

        if not self._thread.is_alive():
            return 0
        return await self.call(cut)

    # -- engine thread -------------------------------------------------------------------
    def _submit(self, cmd) -> None:
        self._cmds.put(cmd)
        self._wake.set()

    def _apply_commands(self) -> None:
        while True:
            try:
                kind, arg, stream, accepted = self._cmds.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                prompt, params, rid, priority, salt = arg
                with self._queued_lock:
                    self._queued -= params.n
                try:
                    self.engine.add_request(prompt, params, request_id=rid, priority=priority, cache_salt=salt)
                except Exception as e:  # a bad request never stops the engine
                    stream.loop.call_soon_threadsafe(_settle, accepted, e)
                    continue
                self._streams[rid] = stream
                stream.loop.call_soon_threadsafe(_settle, accepted, None)
            elif kind == "pin":
                prompt, ttl_s, salt, on_done = arg
                try:
                    self.engine.pin_prefix(prompt, ttl_s, salt, on_done=on_done)
                except Exception as e:
                    stream.loop.call_soon_threadsafe(_settle, accepted, e)
                    continue
                stream.loop.call_soon_threadsafe(_settle, accepted, None)
            elif kind == "call":
                try:
                    result = arg()
                except Exception as e:
                    stream.loop.call_soon_threadsafe(_settle, accepted, e)
                    continue
                stream.loop.call_soon_threadsafe(_resolve, accepted, result)
            else:
                self.engine.abort_request(arg)
                self._streams.pop(arg, None)

    def _run(self) -> None:
        while not self._stop:
            self._apply_commands()
            if not self.engine.has_unfinished_requests():
                self._wake.wait(0.1)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:
                log.exception("engine failed outside a step (scheduling); failing every request")
                self._fail_all(e)
                continue
            # one hand-over per event loop per step, not one per request: each call_soon_threadsafe
            # wakes the loop (a syscall) and contends for the GIL with this thread
            batches: dict[asyncio.AbstractEventLoop, list] = {}
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is None:
                    continue
                if out.finished:
                    del self._streams[out.request_id]
                batches.setdefault(stream.loop, []).append((stream.queue, out))
            for loop, items in batches.items():
                loop.call_soon_threadsafe(_deliver, items)

    def _fail_all(self, error: Exception) -> None:
        """Abort every stream; each raises ``error`` if it is an ``EngineStopped``, else a
        ``RuntimeError`` naming it."""
        if not isinstance(error, EngineStopped):
            error = RuntimeError(f"engine error: {error}")
        for rid, stream in list(self._streams.items()):
            self.engine.abort_request(rid)
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, error)
        self._streams.clear()


def _deliver(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for q, out in items:
        q.put_nowait(out)


def _resolve(fut: asyncio.Future, result) -> None:
    if not fut.done():
        fut.set_result(result)


def _settle(fut: asyncio.Future, error: BaseException | None) -> None:
    if fut.done():
        return
    if error is None:
        fut.set_result(None)
    else:
        fut.set_exception(error)
