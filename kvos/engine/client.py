"""The engine-client contract: what the OpenAI server and ``kvos serve`` need from an engine,
whatever runs it.

Implementations: ``AsyncEngine`` (``kvos.engine.async_engine``: one ``LLMEngine`` on a thread of
the server's process) and ``DataParallelEngine`` (``kvos.distributed``: engines in processes of
their own or Ray actors behind a router; one engine that way is the "process engine").

Every method is called on the server's event loop (``start`` and ``shutdown`` from its
lifespan). A request's outputs reach the submitter through its ``OutputChannel``, read as a
``RequestStream``; an engine that must end a stream early puts an ``EngineStopped`` (or another
exception) into its channel instead of an output.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from kvos.cache.pins import PinInfo
from kvos.core.outputs import RequestOutput
from kvos.core.sampling_params import SamplingParams
from kvos.engine.media import MediaLimits
from kvos.models.config import VisionShape


class EngineStopped(RuntimeError):
    """The server is shutting down: the request was cut (or never taken). The message names the
    option that set the deadline. A 503 (or a stream's error event) with ``code``."""

    code = "draining"


class RequestFailed(RuntimeError):
    """A step that held this request raised inside the engine (its output's ``finish_reason`` is
    ``"error"``); the engine went on with its other requests. A 500 (or a stream's error event)
    whose message is the output's ``stop_reason``."""

    code = "engine_error"


class EngineUnavailable(EngineStopped):
    """No engine can take or finish the request now: the engine serving a stream died, or every
    engine of a data-parallel server is down (retry later)."""

    code = "engine_unavailable"


@dataclass(frozen=True)
class ModelFacts:
    """What a client knows of the model its engines serve (all of them load the same one)."""

    model_id: str
    """The model's fingerprint (``kvos.models.fingerprint``): the prefix-cache hash root's model part."""
    max_model_len: int
    vocab_size: int
    """Token ids valid for this model are ``0 .. vocab_size - 1``."""
    dtype: str | None = None
    """The weight dtype as configured (None: the engine's default, or not known to the client)."""
    device: str | None = None
    """The device as configured (None: not known to the client)."""
    default_sampling: dict[str, float] = field(default_factory=dict, hash=False, compare=False)
    """Sampling values for the fields a request leaves unset (``LLMEngine.default_sampling``)."""
    segment_reuse: bool = False
    """The engines reuse segments (``EngineConfig.segment_reuse``): a chat's messages are sent
    as segments."""
    vision: VisionShape | None = field(default=None, hash=False, compare=False)
    """A vision-language model's image side (None: the model takes no images)."""
    media_folder: Path | None = field(default=None, hash=False, compare=False)
    """The checkpoint folder whose image processor prepares images (None: the model's defaults)."""
    media_limits: MediaLimits | None = field(default=None, hash=False, compare=False)
    """Images per prompt, pixels, remote URLs (``EngineConfig``'s image fields)."""


@dataclass(frozen=True)
class EngineHealth:
    """Whether the client can take requests now (``/health``)."""

    engines_up: int | None = None
    """Engines that can take requests (decode engines when disaggregated); None: one engine in
    this process, whose count is not reported."""
    prefill_engines_up: int | None = None
    """Prefill engines up; None without disaggregation. At 0 the decode engines compute the
    prompts themselves, so the client still serves."""
    engines_down: dict[int, str] | None = None
    """Engines that take no requests now and why ("died", "unresponsive", "failed", "draining")."""

    @property
    def degraded(self) -> bool:
        return bool(self.engines_down)

    @property
    def serving(self) -> bool:
        return self.engines_up != 0

    def json(self) -> dict:
        """The counts that are known, as ``/health`` reports them."""
        out = {k: v for k, v in (("engines_up", self.engines_up), ("prefill_engines_up", self.prefill_engines_up))
               if v is not None}
        if self.engines_down:
            out["engines_down"] = {str(i): why for i, why in self.engines_down.items()}
        return out


@dataclass
class OutputChannel:
    """Where one request's outputs go: a queue read on the submitter's event loop. Items are
    cumulative ``RequestOutput``s, the last one finished, or an exception that ends the stream.
    From another thread put items with ``loop.call_soon_threadsafe``."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)

    @classmethod
    def here(cls) -> OutputChannel:
        """A channel read on the running event loop."""
        return cls(asyncio.get_running_loop())


@runtime_checkable
class EngineClient(Protocol):
    """An engine as the server drives it (see the module's docstring for the threading rule)."""

    tokenizer: Any
    """The engine's tokenizer (a Hugging Face fast tokenizer; not thread-safe: copy it before
    using it off the event loop), or None: token-id prompts only (``skip_tokenizer_init``)."""
    num_pending: int
    """Sequences submitted with no output yet (a prompt with ``n`` samples counts ``n``);
    ``RequestStream`` lowers it as each request's first output arrives."""
    num_queued: int
    """Sequences submitted that no engine has taken yet (on their way to an engine's queue):
    with the engines' own ``waiting``, the sequences not started."""

    @property
    def model_facts(self) -> ModelFacts: ...

    @property
    def num_in_flight(self) -> int:
        """Requests accepted and not finished."""

    def start(self) -> None:
        """Start serving (on the running event loop)."""

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine(s); requests still in flight are dropped."""

    async def submit(self, prompt, params: SamplingParams, request_id: str, priority: int = 0,
                     cache_salt: str | None = None, retriable: bool = False) -> RequestStream:
        """Queue a request (text, or ``{"prompt_token_ids": [...]}`` with or without its
        ``"prompt"`` text); returns once an engine accepted it. Raises ``ValueError`` (naming the
        field) if it is refused, ``EngineStopped`` after ``cut_all`` or when no engine is up.
        ``retriable``: nothing of it reaches the client before it finishes, so it may restart
        on another engine."""

    def abort(self, request_id: str) -> None:
        """Drop a request (a no-op if it is unknown or finished); its blocks are freed."""

    async def pin(self, prompt, ttl_s: float | None, cache_salt: str | None) -> PinInfo:
        """Compute and pin a prefix. ``ValueError`` (naming the field) if refused."""

    async def list_pins(self, pin_ids: set[str]) -> list[PinInfo]:
        """The live pins among ``pin_ids``."""

    async def unpin(self, pin_id: str) -> bool:
        """Release a pin; False if there is none."""

    def stats(self) -> dict:
        """The engine's cache and queue figures (``LLMEngine.stats``' keys; a data-parallel
        client sums its engines' and adds ``engines`` and ``router``)."""

    async def top_prefixes(self, n: int = 10) -> list[dict]:
        """The ``n`` cached prefixes hit most often (``LLMEngine.top_prefixes``: hashes and counts;
        a data-parallel client ranks its engines' together, each row naming its ``engine``)."""

    def health(self) -> EngineHealth: ...

    async def drain(self, timeout: float) -> None:
        """Wait until no request is in flight, or ``timeout`` seconds (graceful shutdown)."""

    async def cut_all(self, reason: str) -> int:
        """End every request in flight with ``EngineStopped(reason)``, and refuse every later
        ``submit`` the same way. Returns how many were cut."""


class RequestStream:
    """Cumulative outputs of one accepted request. ``aclose`` (or leaving ``async for`` early)
    aborts it if unfinished, freeing its blocks at once."""

    def __init__(self, engine: EngineClient, request_id: str, channel: OutputChannel, num_seqs: int = 1) -> None:
        self.engine = engine
        self.num_seqs = num_seqs
        self.request_id = request_id
        self._channel = channel
        self.arrival = time.monotonic()
        self.first_output_time: float | None = None
        self.last: RequestOutput | None = None
        self._pending = True

    def _got_output(self) -> None:
        if self._pending:
            self._pending = False
            self.engine.num_pending -= self.num_seqs
            self.first_output_time = time.monotonic()

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        try:
            while self.last is None or not self.last.finished:
                item = await self._channel.queue.get()
                if isinstance(item, BaseException):
                    raise item
                self._got_output()
                self.last = item
                failed = next((c for c in item.outputs if c.failed), None)
                if failed is not None:
                    raise RequestFailed(str(failed.stop_reason))
                yield item
        finally:
            await self.aclose()

    async def result(self) -> RequestOutput:
        async for _ in self:
            pass
        assert self.last is not None
        return self.last

    async def aclose(self) -> None:
        if self._pending:
            self._pending = False
            self.engine.num_pending -= self.num_seqs
        if self.last is None or not self.last.finished:
            self.engine.abort(self.request_id)
