"""Several engines (Ray actors or local processes) behind one router: the ``EngineClient``
(``kvos.engine.client``) the OpenAI server drives for ``kvos serve --data-parallel N``,
``--prefill-engines`` and ``--transport process``/``ray``."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from kvos.cache.hashing import extend_block_hashes, root_hash
from kvos.cache.pins import PinInfo
from kvos.core.load import EngineLoad
from kvos.core.sampling_params import SamplingParams
from kvos.distributed.engines import (
    TRANSPORTS,
    EngineDied,
    EngineHung,
    ProcessEngines,
    RayEngines,
)
from kvos.distributed.kv_transfer import DEVICE_ROWS, ExtractedBlocks
from kvos.distributed.kv_transfer import TRANSFERS as KV_TRANSFERS
from kvos.distributed.output_delta import OutputAccumulator
from kvos.distributed.worker import EngineInfo, PollResult
from kvos.engine.client import (
    EngineHealth,
    EngineStopped,
    EngineUnavailable,
    ModelFacts,
    OutputChannel,
    RequestStream,
)
from kvos.engine.media import (
    ImagePreparer,
    MediaLimits,
    expand_image_text,
    media_items,
)
from kvos.router.config import RouterConfig
from kvos.router.policies import Router

log = logging.getLogger("kvos.distributed")

ENGINE_TIMEOUT_S = 30.0
"""Default deadline of every call to an engine (a poll: its wait plus this)."""
GAUGES = frozenset({"block_size", "page_bytes", "total", "free", "cached", "used", "kv_usage", "num_blocks",
                    "running", "waiting", "loading", "prefix_hit_rate"})
"""Engine stats that describe now (summed over the engines up); the other numbers are counters,
summed over every engine and its earlier lives so that they never go down."""


@dataclass
class _InFlight:
    request_id: str
    engine: int
    prompt: dict
    params: SamplingParams
    priority: int
    salt: str | None
    retriable: bool
    stream: OutputChannel
    hashes: list[bytes]
    predicted: int
    delivered: bool = False
    prefill_engine: int = -1
    """Disaggregated prefill: the engine that computed the prompt, until its blocks are handed over."""
    output: OutputAccumulator | None = None
    """Its output so far on ``engine`` (rebuilt from the engine's deltas; reset when re-sent)."""
    accepted: bool = False
    """``engine`` took it (its ``add`` returned); until then a failure of ``engine`` is handled
    by the ``_send`` that is adding it, not by ``_engine_down``."""
    tile_keys: tuple[str, ...] = ()
    """Its images' tiles' encoder-cache keys, in prompt order (``MediaItem.key``)."""


@dataclass
class RouterStats:
    """What the router decided and how it turned out (``/metrics``)."""

    routed: list[int] = field(default_factory=list)
    """Requests sent to each engine."""
    predicted_hit_blocks: int = 0
    obtained_hit_blocks: int = 0
    prompt_blocks: int = 0
    retried: int = 0
    cut: int = 0
    engine_failures: int = 0
    resyncs: int = 0
    prefills: int = 0
    """Requests prefilled on a prefill engine (disaggregated)."""
    transferred_blocks: int = 0
    transfer_s: float = 0.0
    """Wall time from taking a prefill's blocks on its engine to the decode engine's accepting
    the request with them stored."""
    transferred_bytes: int = 0
    """Bytes of the blocks stored (known where the rows pass through the front end)."""
    encoder_routed: int = 0
    """Requests sent, against the router's choice, to the engine holding their images' encodings."""


class DataParallelEngine:
    """``num_engines`` ``EngineWorker``s (one per GPU on a GPU host, else processes sharing the
    CPUs) and a router (``kvos.router``; ``router``: a ``RouterConfig``, or a router's name with
    the default settings) choosing one per request. ``transport="ray"``: actors
    on the Ray cluster at ``address`` (``None``: start a local one, or join the one
    ``RAY_ADDRESS`` names); ``"process"``: local processes, no Ray (one engine this way puts
    the engine loop in a process of its own, off the HTTP server's interpreter).

    Everything here runs on the server's event loop: one poll task per engine delivers outputs
    to streams, feeds KV events to the router (resyncing from a snapshot on a gap) and keeps the
    engine's load current. Faults: an engine that dies is dropped by the router at once;
    its requests that have sent nothing to the client yet, or are not streamed (``retriable``),
    are sent to another engine under the same id; a stream already under way ends with an
    error. The engine is restarted (``max_restarts``: by Ray, or here for a process); once it
    answers, the router takes it back with an empty cache.

    Disaggregated prefill (``prefill_engines`` P > 0): P more engines compute prompts. A request
    first runs on a prefill engine (chosen by its own router of the same policy) for one token;
    as it finishes there, that engine keeps its prompt's blocks (``add(export=...)``); once the
    decode engine is chosen, the blocks the router does not predict there are read
    (``take_export``) and go with the request to it (``add(received=...)``), which stores them
    first and computes only the rest of the prompt. Local processes on a
    host's GPUs pass a CUDA IPC handle and the decode engine copies the blocks GPU to GPU into
    its pool (prefix hits there); else host rows travel (through this process) into its
    transfer tier (tier hits). Engines ``0 .. num_engines - 1`` decode; ``num_engines ..`` prefill.

    Encoder engines (``encoder_engines`` E > 0, a vision-language model): E more workers hold
    only the image encoder's work (``EncoderWorker``; on a GPU host, the GPUs after the language
    engines'). Once a request's engine is chosen, the tiles of its images that engine is not
    believed to hold are encoded on an encoder engine and travel as encodings (without pixels);
    the engine stores them in its encoder cache as if it had run the encoder. The front end
    remembers which tile keys it sent to each engine (``ENCODER_MEMORY`` per engine, least
    recently sent first out): an image believed held travels as pixels, so an engine that evicted
    it encodes it itself. Routing is image-aware: the KV-aware router follows the image keys in
    the block hashes; when it predicts no KV hit, an engine believed to hold all the request's
    encodings takes it unless it is busier than the router's choice by more than
    ``ENCODER_HOLDER_SLACK`` requests. An encoder engine that fails or misses its deadline is
    skipped (the language engine encodes).
    """

    ENCODER_MEMORY = 4096
    ENCODER_HOLDER_SLACK = 4

    def __init__(self, engine_kwargs: dict, num_engines: int, router: RouterConfig | str = "kv_aware",
                 address: str | None = None, max_restarts: int = 3, poll_s: float = 0.2, prefill_engines: int = 0,
                 transport: str = "ray", engine_timeout_s: float = ENGINE_TIMEOUT_S, encoder_engines: int = 0,
                 kv_transfer: str = "auto") -> None:
        routing = router if isinstance(router, RouterConfig) else RouterConfig(router)
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        if num_engines < 1:
            raise ValueError(f"data_parallel must be >= 1, got {num_engines}")
        if prefill_engines < 0:
            raise ValueError(f"prefill_engines must be >= 0, got {prefill_engines}")
        if encoder_engines < 0:
            raise ValueError(f"encoder_engines must be >= 0, got {encoder_engines}")
        if kv_transfer not in ("auto", *KV_TRANSFERS):
            raise ValueError(f"kv_transfer must be one of {('auto', *KV_TRANSFERS)}, got {kv_transfer!r}")
        if kv_transfer == "ipc" and transport == "ray":
            raise ValueError("kv_transfer 'ipc': Ray actors see only their own GPUs; use 'p2p' (NCCL send/recv)")
        if not engine_timeout_s > 0:
            raise ValueError(f"engine_timeout_s must be > 0, got {engine_timeout_s}")
        self.engine_timeout_s = engine_timeout_s
        total = num_engines + prefill_engines
        # KV events feed the router; one engine has nothing to route (and pickling a step's
        # events cost the front end about a fifth of its time serving 256 streams on an H100)
        kwargs = [{**engine_kwargs, "kv_events": total > 1}] * total
        if prefill_engines and engine_kwargs.get("tensor_parallel_size", 1) == 1:  # decode engines receive the
            # prompts' blocks as host rows into a transfer tier (tensor-parallel ones write them, as device rows)
            kwargs[:num_engines] = [{**kwargs[0], "kv_transfer_gb": engine_kwargs.get("kv_transfer_gb") or 1.0}
                                    ] * num_engines
            # prefill engines read a finished prompt's blocks between steps: without a step
            # already queued behind (async scheduling), that read runs at once
            if engine_kwargs.get("async_scheduling") is None:
                kwargs[num_engines:] = [{**kwargs[0], "async_scheduling": False}] * prefill_engines
        self.transport = transport
        self.engines = (RayEngines(kwargs, address, max_restarts) if transport == "ray"
                        else ProcessEngines(kwargs, max_restarts))
        infos: list[EngineInfo] = [self.engines.call_sync(i, "info") for i in range(total)]
        self.info = infos[0]
        if len({i.model_id for i in infos}) != 1:
            raise RuntimeError("data_parallel: the engines loaded different models")
        self.tokenizer = self.engines.call_sync(0, "tokenizer")
        self.max_model_len = self.info.max_model_len
        self.model_id = self.info.model_id
        self.model_facts = ModelFacts(self.model_id, self.max_model_len, self.info.vocab_size,
                                      default_sampling=dict(self.info.default_sampling),
                                      segment_reuse=self.info.segment_reuse, vision=self.info.vision,
                                      media_folder=self.info.media_folder, media_limits=self.info.media_limits)
        self._media: ImagePreparer | None = None  # prepares images given to submit unprepared
        self.block_size = self.info.block_size
        self.router_name = routing.router
        self.engine_stats: list[dict] = [self.engines.call_sync(i, "stats") for i in range(total)]
        self.placements: list[dict] = [self.engines.call_sync(i, "placement") for i in range(total)]
        """Where each engine runs (``EngineWorker.placement``), refreshed when it restarts."""
        on_gpus = all(p.get("device", "").startswith("cuda") for p in self.placements)
        if kv_transfer == "ipc" and not self.engines.device_transfer:
            raise ValueError("kv_transfer 'ipc' needs engines that are processes of one GPU host")
        self.kv_transfer = kv_transfer if kv_transfer != "auto" else (
            "ipc" if self.engines.device_transfer else "p2p" if on_gpus else "host")
        """How prefill engines hand blocks to decode engines (``kv_transfer.TRANSFERS``): CUDA IPC
        between processes of one GPU host, NCCL send/recv between Ray actors on GPUs (on one host
        or between hosts), host rows otherwise."""
        capacity = max(1, self.engine_stats[0].get("total") or 2000)  # approx remembers a pool's worth
        self.num_decode = num_engines
        self.router = routing.build(num_engines, self.block_size, capacity)
        self.prefill_router = routing.build(prefill_engines, self.block_size, capacity) if prefill_engines else None
        self._engine_kwargs = kwargs[0]
        self.loads = [EngineLoad() for _ in range(total)]
        self.down = [False] * total
        self.down_reason: list[str | None] = [None] * total
        """Why engine i takes no requests: "died" (restarting), "unresponsive" (missed a deadline;
        back when it answers), "failed" (out of restarts, reaped), "draining"/"removed" (admin)."""
        self._retired: dict[str, float] = {}  # counters of engines' earlier lives (before a restart)
        self.router_stats = RouterStats(routed=[0] * total)
        self.poll_s = poll_s
        self.num_pending = 0  # sequences submitted with no output yet (the event loop only)
        self.num_queued = 0  # sequences submitted and not yet taken by an engine (the event loop only)
        self._inflight: dict[str, _InFlight] = {}
        self._tasks: list[asyncio.Task] = []
        self._closed: str | None = None
        self._held: list[OrderedDict[str, None]] = [OrderedDict() for _ in range(total)]
        """Tile keys sent to each engine (as pixels or encodings): believed in its encoder cache."""
        self.encoders: RayEngines | ProcessEngines | None = None
        self.encoder_down: list[bool] = []
        self.encoder_engine_stats = {"encoder_engine_runs": 0, "encoder_engine_seconds": 0.0,
                                     "encoder_engine_failures": 0, "encodings_sent": 0}
        self._next_encoder = 0
        if encoder_engines:
            if self.info.vision is None:
                self.shutdown()
                raise ValueError("encoder_engines: the model takes no images")
            ekw = [{**engine_kwargs, "role": "encoder"}] * encoder_engines
            try:
                self.encoders = (RayEngines(ekw, address, max_restarts) if transport == "ray"
                                 else ProcessEngines(ekw, max_restarts, gpu_offset=total))
            except BaseException:
                self.shutdown()
                raise
            self.encoder_down = [False] * encoder_engines

    # -- the EngineClient interface --------------------------------------------------------
    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._poll_loop(i)) for i in range(len(self.engines))]

    async def stop_polling(self) -> None:
        """Cancel the poll tasks and wait for them (on the loop that ``start`` ran on)."""
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    def shutdown(self, timeout: float = 10.0) -> None:
        for t in self._tasks:
            t.cancel()
        if self.encoders is not None:  # first: the language engines' container may own the Ray session
            self.encoders.shutdown()
        self.engines.shutdown()

    async def _call(self, i: int, method: str, *args, timeout: float | None = None):
        """``engines.call`` with a deadline (``engine_timeout_s`` unless given): ``EngineHung``
        past it, ``EngineDied`` if the engine is gone."""
        limit = self.engine_timeout_s if timeout is None else timeout
        task = asyncio.ensure_future(self.engines.call(i, method, *args))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # a late failure is not an error
        try:
            done, _ = await asyncio.wait({task}, timeout=limit)
        except asyncio.CancelledError:  # (not ``wait_for``: a cancelled caller never waits for the engine)
            task.cancel()
            raise
        if not done:
            task.cancel()
            raise EngineHung(f"engine {i} did not answer {method} within {limit:.0f} s")
        return task.result()

    def _hashes(self, prompt: dict, salt: str | None) -> tuple[list[bytes], tuple[str, ...]]:
        """The prompt's block hashes as its engine computes them, with its images' keys in the
        blocks that hold their tokens (so the KV-aware router follows an image's KV), and those
        keys (one per tile, in prompt order)."""
        ids = prompt["prompt_token_ids"]
        media = ()
        data = prompt.get("multi_modal_data")
        if data is not None and self.info.vision is not None:
            media = media_items(ids, data["image"], self.info.vision, salt)
        hashes: list[bytes] = []
        extend_block_hashes(hashes, ids[: len(ids) - 1], self.block_size, root_hash(self.model_id, salt), media)
        return hashes, tuple(m.key for m in media)

    def _prepare_images(self, prompt) -> dict:
        """``multi_modal_data``'s images decoded and preprocessed here (once, not per engine)."""
        data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        if data is None:
            return prompt
        if self.info.vision is None:
            raise ValueError("multi_modal_data: this model takes no images")
        if self._media is None:
            self._media = ImagePreparer(self.info.vision, self.info.media_folder, self.info.media_limits or MediaLimits())
        prepared = self._media.prepare_all(data)
        return {**prompt, "multi_modal_data": {"image": prepared}}

    def _tokenize(self, prompt) -> dict:
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt
        from kvos.engine.llm_engine import encode_prompt

        text = prompt["prompt"] if isinstance(prompt, dict) else prompt
        if not isinstance(text, str):
            raise ValueError("prompt must be a string or a dict with prompt_token_ids")
        data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        if data is not None:  # the images' placeholders become their tokens, as the engine does
            text = expand_image_text(text, self.tokenizer, self.info.vision, data["image"])
            return {**prompt, "prompt": text, "prompt_token_ids": encode_prompt(self.tokenizer, text)}
        return {"prompt": text, "prompt_token_ids": encode_prompt(self.tokenizer, text)}

    async def submit(self, prompt, params: SamplingParams, request_id: str, priority: int = 0,
                     cache_salt: str | None = None, retriable: bool = False) -> RequestStream:
        """Route and queue a request; returns once an engine accepted it. Raises ``ValueError``
        (naming the field) if the engine rejects it. ``retriable``: nothing of it reaches the
        client before it finishes (not streamed), so it may restart on another engine."""
        if self._closed is not None:
            raise EngineStopped(self._closed)
        prompt = self._tokenize(self._prepare_images(prompt))
        hashes, keys = self._hashes(prompt, cache_salt)
        stream = OutputChannel.here()
        rec = _InFlight(request_id, -1, prompt, params, priority, cache_salt, retriable, stream, hashes, 0,
                        tile_keys=keys)
        self.num_pending += params.n
        self.num_queued += params.n
        try:
            if self.prefill_router is not None and self._worth_prefilling(rec):
                await self._prefill(rec)
            await self._send(rec)
        except BaseException:
            self.num_pending -= params.n
            raise
        finally:
            self.num_queued -= params.n
        return RequestStream(self, request_id, stream, params.n)

    def _count(self, i: int, rec: _InFlight) -> None:
        """Add a request being sent to engine ``i`` to its load at once, before the engine
        answers (the engine's own figure replaces it at the next poll), so that a burst routed
        before that poll spreads: its prompt less the blocks the router predicts there."""
        load = self.loads[i]
        new_tokens = max(0, len(rec.prompt["prompt_token_ids"]) - rec.predicted * self.block_size)
        self.loads[i] = dataclasses.replace(load, waiting=load.waiting + rec.params.n,
                                            prefill_tokens=load.prefill_tokens + new_tokens)


    def _worth_prefilling(self, rec: _InFlight) -> bool:
        """Whether a prefill engine should compute ``rec``'s prompt: not when the router
        predicts that a decode engine already holds every full block of it."""
        return bool(rec.hashes) and all(self.router.predicted_hits(e, rec.hashes) < len(rec.hashes)
                                        for e in range(self.num_decode))

    def _router_of(self, i: int) -> tuple[Router, int]:
        """The router that chooses engine ``i``, and ``i``'s number there."""
        if i < self.num_decode:
            return self.router, i
        assert self.prefill_router is not None
        return self.prefill_router, i - self.num_decode

    async def _prefill(self, rec: _InFlight) -> None:
        """Run ``rec``'s prompt on a prefill engine for one token; as it finishes, that engine
        keeps the prompt's blocks for ``take_export``. On any failure the decode engine simply
        computes the whole prompt."""
        assert self.prefill_router is not None
        if all(self.down[self.num_decode:]):
            return  # no prefill engine is up
        j = self.prefill_router.choose(rec.hashes, self.loads[self.num_decode:])
        self.prefill_router.on_routed(j, rec.hashes)
        i = self.num_decode + j
        pre = _InFlight(f"{rec.request_id}-prefill", i, rec.prompt, SamplingParams(temperature=0, max_tokens=1),
                        rec.priority, rec.salt, True, OutputChannel.here(), rec.hashes, 0)
        self._inflight[pre.request_id] = pre
        try:
            self._count(i, pre)
            self.router_stats.routed[i] += 1
            await self._call(i, "add", pre.request_id, rec.prompt["prompt_token_ids"], pre.params,
                             rec.priority, rec.salt, rec.hashes, self.kv_transfer, None, (),
                             rec.prompt.get("multi_modal_data"))
            while True:
                item = await pre.stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    break
            rec.prefill_engine = i
            self.router_stats.prefills += 1
        except Exception as err:
            log.warning("prefill of %s failed (%s); its decode engine computes the prompt", rec.request_id, err)
        finally:
            self._inflight.pop(pre.request_id, None)

    async def _send(self, rec: _InFlight) -> None:
        """Choose an engine for ``rec`` and add it there (another, if that one is found dead);
        a prefilled request's blocks are stored there first."""
        while True:
            if not self.engines_up():
                raise EngineUnavailable("no engine is up to take this request; retry later")
            e = self._prefer_holder(self.router.choose(rec.hashes, self.loads[: self.num_decode]), rec)
            rec.engine, rec.predicted = e, self.router.predicted_hits(e, rec.hashes)
            rec.output, rec.accepted = None, False
            self._inflight[rec.request_id] = rec
            self.router.on_routed(e, rec.hashes)  # (before the awaits: a burst sees this choice)
            self._count(e, rec)
            try:
                await self._add_with_blocks(e, rec)
            except EngineDied as err:
                self._inflight.pop(rec.request_id, None)
                self._engine_down(e, "unresponsive" if isinstance(err, EngineHung) else "died")
                if isinstance(err, EngineHung):
                    self.engines.notify(e, "abort", rec.request_id)  # it may have taken it
                continue
            except BaseException:
                self._inflight.pop(rec.request_id, None)
                raise
            rec.accepted = True
            self.router_stats.routed[e] += 1
            self.router_stats.predicted_hit_blocks += rec.predicted
            self.router_stats.prompt_blocks += len(rec.hashes)
            return

    async def _add_with_blocks(self, e: int, rec: _InFlight) -> None:
        """Add ``rec`` on decode engine ``e``, with the blocks its prefill engine exported (once:
        a retry on another engine computes the prompt). A failure of the prefill side only costs
        that; ``EngineDied`` of ``e`` is raised."""
        found: ExtractedBlocks | None = None
        source, rec.prefill_engine = rec.prefill_engine, -1
        t0 = time.perf_counter()
        if source >= 0:
            try:
                found = await self._call(source, "take_export", f"{rec.request_id}-prefill", rec.predicted)
            except Exception as err:
                log.warning("blocks of %s could not be read on its prefill engine (%s)", rec.request_id, err)
        media = await self._encode_images(e, rec)
        try:
            stored = await self._call(e, "add", rec.request_id, rec.prompt["prompt_token_ids"], rec.params,
                                      rec.priority, rec.salt, None, False, found,
                                      rec.prompt.get("segment_spans") or (), media)
            self._remember_held(e, rec)
        finally:
            if found is not None and isinstance(found.rows, DEVICE_ROWS):
                self.engines.notify(source, "transfer_done", found.rows.nbytes)
        if found is not None and found.hashes:
            self.router_stats.transferred_blocks += stored
            self.router_stats.transfer_s += time.perf_counter() - t0
            self.router_stats.transferred_bytes += found.nbytes * stored // len(found.hashes)

    # -- images: encoder engines and image-aware routing -----------------------------------
    def _prefer_holder(self, e: int, rec: _InFlight) -> int:
        """The router's choice ``e``, or (no KV hit predicted there) an engine believed to hold
        every encoding of ``rec``'s images and at most ``ENCODER_HOLDER_SLACK`` requests busier."""
        keys = rec.tile_keys
        if not keys or self.router.predicted_hits(e, rec.hashes) > 0 or all(k in self._held[e] for k in keys):
            return e
        busy = self.loads[e].waiting + self.loads[e].running
        for h in range(self.num_decode):
            if (h != e and not self.down[h] and all(k in self._held[h] for k in keys)
                    and self.loads[h].waiting + self.loads[h].running <= busy + self.ENCODER_HOLDER_SLACK):
                self.router_stats.encoder_routed += 1
                return h
        return e

    def _remember_held(self, e: int, rec: _InFlight) -> None:
        held = self._held[e]
        for k in rec.tile_keys:
            held[k] = None
            held.move_to_end(k)
        while len(held) > self.ENCODER_MEMORY:
            held.popitem(last=False)

    async def _encode_images(self, e: int, rec: _InFlight) -> dict | None:
        """``rec``'s ``multi_modal_data`` for engine ``e``: images with a tile ``e`` is not
        believed to hold are encoded on an encoder engine (one batch) and go as encodings; the
        rest as they are. Without encoder engines, or when none answers, unchanged."""
        data = rec.prompt.get("multi_modal_data")
        if self.encoders is None or not data:
            return data
        images, held, todo, at = data["image"], self._held[e], [], 0
        for i, im in enumerate(images):  # (rec.tile_keys: each image's tiles in turn)
            if im.tiles is not None and not all(k in held for k in rec.tile_keys[at: at + im.num_tiles]):
                todo.append(i)
            at += im.num_tiles
        if not todo:
            return data
        encodings = await self._run_encoder([tile for i in todo for tile in images[i].tiles])
        if encodings is None:
            return data
        out, at = list(images), 0
        for i in todo:
            n = images[i].num_tiles
            out[i] = images[i].encoded(encodings[at: at + n])
            at += n
        self.encoder_engine_stats["encodings_sent"] += len(encodings)
        return {**data, "image": out}

    async def _run_encoder(self, tiles: list) -> list | None:
        """``tiles`` encoded on the next encoder engine that answers within the deadline; None
        when none does (the language engine encodes them)."""
        assert self.encoders is not None
        n = len(self.encoder_down)
        for _ in range(n):
            j, self._next_encoder = self._next_encoder % n, self._next_encoder + 1
            if self.encoder_down[j]:
                continue
            t0 = time.perf_counter()
            try:
                out = await asyncio.wait_for(self.encoders.call(j, "encode", tiles), self.engine_timeout_s)
            except Exception as err:
                log.warning("encoder engine %d failed (%r); it is skipped", j, err)
                self.encoder_down[j] = True
                self.encoder_engine_stats["encoder_engine_failures"] += 1
                continue
            self.encoder_engine_stats["encoder_engine_runs"] += len(tiles)
            self.encoder_engine_stats["encoder_engine_seconds"] += time.perf_counter() - t0
            return out
        return None

    def abort(self, request_id: str) -> None:
        rec = self._inflight.pop(request_id, None)
        if rec is not None and not self.down[rec.engine]:
            self.engines.notify(rec.engine, "abort", request_id)

    def _single(self) -> None:
        if len(self.engines) != 1:
            raise ValueError("prompt: pinned prefixes need a single engine; this server runs --data-parallel")

    async def pin(self, prompt, ttl_s: float | None, cache_salt: str | None) -> PinInfo:
        """With one engine (``--transport process``): pin on it."""
        self._single()
        return await self.engines.call(0, "pin", self._tokenize(prompt)["prompt_token_ids"], ttl_s, cache_salt)

    async def list_pins(self, pin_ids: set[str]) -> list[PinInfo]:
        self._single()
        return await self.engines.call(0, "list_pins", pin_ids)

    async def unpin(self, pin_id: str) -> bool:
        self._single()
        return await self.engines.call(0, "unpin", pin_id)

    @property
    def num_in_flight(self) -> int:
        return len(self._inflight)

    async def drain(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        while self._inflight and time.monotonic() < end:
            await asyncio.sleep(0.05)

    async def cut_all(self, reason: str) -> int:
        self._closed = reason
        n = len(self._inflight)
        for rid in list(self._inflight):
            rec = self._inflight[rid]
            self.abort(rid)
            rec.stream.queue.put_nowait(EngineStopped(reason))
        return n

    # -- engines ---------------------------------------------------------------------------
    async def _poll_loop(self, i: int) -> None:
        while self.down_reason[i] != "removed":
            if self.down[i]:
                await self._await_restart(i)
                continue
            try:
                res: PollResult = await self._call(i, "poll", self.poll_s, timeout=self.poll_s + self.engine_timeout_s)
            except EngineDied as err:
                self._engine_down(i, "unresponsive" if isinstance(err, EngineHung) else "died")
                continue
            except asyncio.CancelledError:
                raise
            except Exception:  # never let one bad poll end the loop
                log.exception("engine %d: poll failed", i)
                await asyncio.sleep(self.poll_s)
                continue
            await self._apply(i, res)

    async def _apply(self, i: int, res: PollResult) -> None:
        for delta in res.outputs:
            rec = self._inflight.get(delta[0])
            if rec is None or rec.engine != i:
                continue  # aborted, or moved to another engine
            if rec.output is None:
                rec.output = OutputAccumulator(rec.prompt.get("prompt"), rec.prompt["prompt_token_ids"])
            out = rec.output.apply(delta)
            out.metrics["engine"] = i
            if not rec.delivered:
                rec.delivered = True
                self.router_stats.obtained_hit_blocks += min(len(rec.hashes), out.num_cached_tokens // self.block_size)
            if out.finished:
                del self._inflight[out.request_id]
            rec.stream.queue.put_nowait(out)
        for rid, error in res.failed.items():
            rec = self._inflight.pop(rid, None)
            if rec is not None:
                rec.stream.queue.put_nowait(RuntimeError(error))
        router, local = self._router_of(i)
        for batch in res.events:
            if not router.on_events(local, batch):
                self.router_stats.resyncs += 1
                try:
                    router.on_snapshot(local, await self._call(i, "snapshot"))
                except Exception:  # the engine died meanwhile: its poll notices
                    break
        self.loads[i] = res.load
        old = self.engine_stats[i]
        new_life = old.get("pid") is not None and res.stats.get("pid") != old.get("pid")
        if new_life:  # keep the old counts
            for k, v in old.items():
                if k not in GAUGES and isinstance(v, (int, float)) and not isinstance(v, bool) and k != "pid":
                    self._retired[k] = self._retired.get(k, 0) + v
        self.engine_stats[i] = res.stats
        if new_life:  # a restart may have moved it
            with contextlib.suppress(Exception):
                self.placements[i] = await self._call(i, "placement")

    def _engine_down(self, i: int, reason: str = "died") -> None:
        """Engine ``i`` died or missed a deadline (``reason``): stop routing to it, move or cut its
        requests (an unresponsive engine is told to abort them, for when it wakes)."""
        if self.down[i]:
            return
        log.warning("engine %d %s; routing around it until it answers again", i,
                    "died" if reason == "died" else "did not answer within its deadline")
        self.down[i] = True
        self.down_reason[i] = reason
        self.router_stats.engine_failures += 1
        self.loads[i] = EngineLoad()
        router, local = self._router_of(i)
        router.on_engine_removed(local)
        for rec in [r for r in self._inflight.values()
                    if r.engine == i and (r.accepted or r.request_id.endswith("-prefill"))]:
            if rec.request_id.endswith("-prefill"):  # its _prefill gives up; decode computes the prompt
                del self._inflight[rec.request_id]
                rec.stream.queue.put_nowait(RuntimeError(f"prefill engine {i} failed"))
            elif (rec.retriable or not rec.delivered) and self.engines_up():
                self.router_stats.retried += 1
                asyncio.get_running_loop().create_task(self._resend(rec))
            else:
                del self._inflight[rec.request_id]
                self.router_stats.cut += 1
                rec.stream.queue.put_nowait(EngineUnavailable(
                    f"engine {i} failed while this request was streaming; retry it"))
            if reason == "unresponsive":
                self.engines.notify(i, "abort", rec.request_id)

    async def _resend(self, rec: _InFlight) -> None:
        try:
            await self._send(rec)
        except Exception as err:
            self._inflight.pop(rec.request_id, None)
            rec.stream.queue.put_nowait(EngineUnavailable(f"its engine failed and no other could take it: {err}"))

    async def _await_restart(self, i: int) -> None:
        """Wait until engine ``i`` is running (restarted if it died) and answers a ping within the
        deadline, then route to it again, its cache as its snapshot says."""
        if self.down_reason[i] in ("removed", "draining"):
            await asyncio.sleep(1.0)
            return
        if not await self.engines.revive(i):
            if self.engines.restarts_left(i) == 0:
                self.down_reason[i] = "failed"
            await asyncio.sleep(1.0)
            return
        try:
            await self._call(i, "ping", timeout=min(5.0, self.engine_timeout_s))
        except EngineDied as err:
            if not isinstance(err, EngineHung):
                self.down_reason[i] = "died"
            await asyncio.sleep(1.0)
            return
        if self.down_reason[i] in ("removed", "draining"):  # an admin call meanwhile
            return
        log.info("engine %d is back", i)
        router, local = self._router_of(i)
        with contextlib.suppress(Exception):  # an engine that woke keeps its cache: learn it
            router.on_snapshot(local, await self._call(i, "snapshot"))
        router.live[local] = True
        self.down[i] = False
        self.down_reason[i] = None

    # -- administration (authenticated /admin endpoints) ------------------------------------
    def _check_index(self, i: int) -> None:
        if not 0 <= i < len(self.down) or self.down_reason[i] == "removed":
            raise ValueError(f"engine: no engine {i} (engines: {[j for j in range(len(self.down)) if self.down_reason[j] != 'removed']})")

    def drain_engine(self, i: int) -> None:
        """Send engine ``i`` no new requests; those it runs finish there."""
        self._check_index(i)
        if self.down_reason[i] is None:
            router, local = self._router_of(i)
            router.live[local] = False
            self.down_reason[i] = "draining"

    def resume_engine(self, i: int) -> None:
        """Route to a drained engine again."""
        self._check_index(i)
        if self.down_reason[i] == "draining":
            router, local = self._router_of(i)
            router.live[local] = True
            self.down_reason[i] = None

    async def remove_engine(self, i: int, timeout: float) -> int:
        """Drain engine ``i``, wait up to ``timeout`` for its requests (then move or cut the
        rest, as for a dead engine), and stop its process for good. Returns the requests it
        still held at the end."""
        self._check_index(i)
        if i >= self.num_decode or self.num_decode - sum(r == "removed" for r in self.down_reason) <= 1:
            raise ValueError(f"engine: engine {i} is the last decode engine or a prefill engine; it cannot be removed")
        self.drain_engine(i)
        end = time.monotonic() + timeout
        while any(r.engine == i for r in self._inflight.values()) and time.monotonic() < end:
            await asyncio.sleep(0.05)
        left = sum(r.engine == i for r in self._inflight.values())
        self.down_reason[i] = None
        self._engine_down(i, "removed")
        await asyncio.to_thread(self.engines.stop_engine, i)
        return left

    async def add_engine(self) -> int:
        """Start one more decode engine with the others' settings; it takes requests once built.
        Returns its index."""
        if self.prefill_router is not None:
            raise ValueError("engine: engines are added to a fleet without prefill engines")
        i = await asyncio.to_thread(self.engines.add_engine, self._engine_kwargs)
        self.loads.append(EngineLoad())
        self._held.append(OrderedDict())
        self.down.append(False)
        self.down_reason.append(None)
        self.engine_stats.append(await self._call(i, "stats"))
        self.placements.append(await self._call(i, "placement"))
        self.router_stats.routed.append(0)
        assert self.router.on_engine_added() == i
        self.num_decode += 1
        self._tasks.append(asyncio.get_running_loop().create_task(self._poll_loop(i)))
        return i

    # -- observability ---------------------------------------------------------------------
    def engines_up(self) -> int:
        """Engines that can take requests now (decode engines in disaggregated mode): ``/health``
        is 503 at 0."""
        return sum(not d and r is None for d, r in zip(self.down[: self.num_decode], self.down_reason))

    def prefill_engines_up(self) -> int | None:
        """Prefill engines up (None without disaggregation). At 0 the decode engines compute
        the prompts themselves, so ``/health`` stays ok."""
        return None if self.prefill_router is None else sum(not d for d in self.down[self.num_decode:])

    def health(self) -> EngineHealth:
        down = {i: r for i, r in enumerate(self.down_reason) if r is not None and r != "removed"}
        return EngineHealth(self.engines_up(), self.prefill_engines_up(), down or None)

    async def top_prefixes(self, n: int = 10) -> list[dict]:
        """The ``n`` most-hit cached prefixes of every engine up, ranked together; each row names
        its ``engine``. An engine that fails to answer is left out."""
        live = [i for i, d in enumerate(self.down) if not d]
        answers = await asyncio.gather(*(self._call(i, "top_prefixes", n) for i in live),
                                       return_exceptions=True)
        rows = [{**row, "engine": i} for i, found in zip(live, answers) if not isinstance(found, BaseException)
                for row in found]
        rows.sort(key=lambda r: (-r["hits"], -r["tokens"], r["engine"]))
        return rows[:n]

    def stats(self) -> dict:
        """The engines' figures summed (numbers at the top level), each engine's own under
        ``engines``, and the router's under ``router``."""
        live = [s for s, d in zip(self.engine_stats, self.down) if not d] or [self.engine_stats[0]]
        total: dict = {k: v for k, v in live[0].items()
                       if not isinstance(v, (dict, list)) and k != "pid" and (k in GAUGES or not isinstance(v, (int, float)))}
        for s in live[1:]:  # gauges: the engines up now
            for k, v in s.items():
                if k in GAUGES and isinstance(v, (int, float)) and isinstance(total.get(k), (int, float)):
                    total[k] += v
        for s in [*self.engine_stats, self._retired]:  # counters: every engine, every life
            for k, v in s.items():
                if k not in GAUGES and k != "pid" and isinstance(v, (int, float)) and not isinstance(v, bool):
                    total[k] = total.get(k, 0) + v
        encoders = [s["encoder"] for s in self.engine_stats if isinstance(s.get("encoder"), dict)]
        if encoders:  # a vision-language model: every engine's encoder and encoder group, summed
            total["encoder"] = {k: sum(e.get(k, 0) for e in encoders) for k in encoders[0]}
        if total.get("total"):
            total["kv_usage"] = total["used"] / total["total"]
        if total.get("prefix_queries_tokens"):
            total["prefix_hit_rate"] = total["prefix_hits_tokens"] / total["prefix_queries_tokens"]
        total["engines"] = [{"engine": i, "role": "decode" if i < self.num_decode else "prefill", "up": not d,
                             "state": self.down_reason[i] or "up", **s}
                            for i, (s, d) in enumerate(zip(self.engine_stats, self.down))]
        total["router"] = {"policy": self.router_name, **vars(self.router_stats)}
        if self.encoders is not None:
            total["encoder_engines"] = {**self.encoder_engine_stats, "up": self.encoder_down.count(False),
                                        "engines": len(self.encoder_down)}
        return total

