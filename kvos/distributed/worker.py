"""One engine behind a router: an ``LLMEngine`` stepping on its own thread, driven by plain calls
(add, abort, poll) that a Ray actor exposes to the front end."""
from __future__ import annotations

import logging
import os
import threading
import time
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path

from kvos.cache.pins import PinInfo
from kvos.core.kv_events import KVEventBatch, KVSnapshot
from kvos.core.load import EngineLoad
from kvos.core.outputs import RequestOutput
from kvos.core.sampling_params import SamplingParams
from kvos.distributed.block_export import BlockExports
from kvos.distributed.kv_transfer import DeviceRows, ExtractedBlocks, PeerRows, RankRows
from kvos.distributed.output_delta import DeltaEncoder, OutputDelta
from kvos.engine.media import MediaLimits
from kvos.models.config import VisionShape

log = logging.getLogger("kvos.distributed")


@dataclass
class EngineInfo:
    """What the front end needs to know about the engines (all of them load the same model)."""

    engine_id: str
    model_id: str
    """The prefix-cache hash root's model part: the router hashes prompts with it."""
    block_size: int
    max_model_len: int
    pid: int
    vocab_size: int
    default_sampling: dict = field(default_factory=dict)
    segment_reuse: bool = False
    vision: VisionShape | None = None
    """A vision-language model's image side: the front end pairs images with image tokens and
    hashes their keys into the prompt's blocks, as the engines do."""
    media_folder: Path | None = None
    media_limits: MediaLimits | None = None


@dataclass
class PollResult:
    outputs: list[OutputDelta] = field(default_factory=list)
    """What every request that changed since the last poll gained (``DeltaEncoder``)."""
    failed: dict[str, str] = field(default_factory=dict)
    """Requests a failed step cut, with the error."""
    events: list[KVEventBatch] = field(default_factory=list)
    """KV event batches in order (numbered: a gap means the subscriber must resync)."""
    load: EngineLoad = field(default_factory=EngineLoad)
    stats: dict = field(default_factory=dict)


class EngineWorker:
    """Owns one ``LLMEngine`` (with KV events on) and its stepping thread.

    Thread rules: the engine is only touched on the stepping thread; ``add``, ``abort`` and
    ``poll`` may be called from other threads (a Ray actor with ``max_concurrency`` > 1): they
    hand commands over under ``_lock`` and wait on ``_changed``. Outputs are coalesced per
    request (each is cumulative), so a slow poller never grows memory beyond one output per
    request in flight. A poll answers with deltas (``DeltaEncoder``: what each request gained
    since the previous poll), encoded under ``_lock``.
    """

    STATS_EVERY_S = 0.1
    """The engine's full figures (for /metrics) are refreshed at most this often while it is
    busy, and once when it goes idle; its load (for routing) after every step."""

    MAX_EVENT_BATCHES = 1024
    """Unpolled event batches kept at most; older ones are dropped (the subscriber sees the gap
    and resyncs from a snapshot)."""

    def __init__(self, engine_kwargs: dict, engine_index: int = 0, torch_threads: int | None = None) -> None:
        import torch

        from kvos.config import EngineConfig
        from kvos.engine.llm_engine import LLMEngine

        if torch_threads:
            torch.set_num_threads(torch_threads)
        self.engine = LLMEngine(EngineConfig(**{"kv_events": True, **engine_kwargs}))
        self.engine_id = f"engine-{engine_index}"
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._cmds: list[tuple] = []
        self._outputs: dict[str, RequestOutput] = {}
        self._encoder = DeltaEncoder()
        self._aborted: list[str] = []
        self._failed: dict[str, str] = {}
        self._events: list[KVEventBatch] = []
        self._load = EngineLoad()
        self._stats: dict = {**self.engine.stats(), "pid": os.getpid()}
        self._stats_at = time.monotonic()
        self._stop = False
        self.exports = BlockExports(self.engine, self._release_blocks)
        self._thread = threading.Thread(target=self._run, name=f"kvos-{self.engine_id}", daemon=True)
        self._thread.start()

    # -- called by the front end -------------------------------------------------------
    def info(self) -> EngineInfo:
        e = self.engine
        return EngineInfo(self.engine_id, e.kv.model_id, e.kv.block_size, e.max_model_len, os.getpid(),
                          e.model_config.vocab_size, dict(e.default_sampling), e.config.segment_reuse,
                          e.model_config.vision, e.model_path if e.model_path.is_dir() else None,
                          e.media.limits if e.media is not None else None)

    def tokenizer(self):
        return self.engine.tokenizer

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, priority: int = 0,
            cache_salt: str | None = None, export: list[bytes] | None = None, transfer: str = "host",
            received: ExtractedBlocks | None = None, segment_spans: tuple = (),
            multi_modal_data: dict | None = None) -> int:
        """Queue a request; raises ``ValueError`` (naming the field) if the engine refuses it.
        ``segment_spans``: the prompt's segments (segment reuse); ``multi_modal_data``: its images
        (``PreparedImage``s, as ``LLMEngine.add_request`` takes them).

        Disaggregated prefill: ``export`` (on a prefill engine): when the request finishes, the
        blocks of these hashes that the cache holds are kept (referenced) for ``take_export``
        (``transfer``: in the form ``kv_transfer.TRANSFERS`` names). ``received``
        (on a decode engine): blocks another engine exported, stored first: device rows are
        opened at once, with a small read that wakes the link (``LLMEngine.warm_adoption``),
        and copied into this engine's pool between steps, just before the request is queued
        (``RankRows``: each rank copies its part); ``PeerRows`` are pulled here over their channel
        (one rank; a tensor-parallel engine's ranks pull their parts at the step boundary); host
        rows go into the transfer tier, or without one (tensor parallelism) are written like device
        rows. Returns how many blocks were stored."""
        stored = 0
        rows = received.rows if received is not None and received.hashes else None
        if isinstance(rows, PeerRows):
            if len(rows.tickets) == 1:  # pulled now, beside the steps
                try:
                    received = replace(received, rows=replace(rows, received=self.engine.runner.receive_peer_rows(rows)))
                except Exception:  # the request computes the blocks itself
                    log.exception("%s: pulling %s's blocks failed", self.engine_id, request_id)
                    received = None
        elif isinstance(rows, (DeviceRows, RankRows)):  # opened here to wake the link before the step boundary
            try:
                received = replace(received, rows=rows.open())
                self.engine.warm_adoption(received.rows)
            except Exception:  # the request computes the blocks itself
                log.exception("%s: opening %s's blocks failed", self.engine_id, request_id)
                received = None
        elif rows is not None and getattr(self.engine.offload, "transfer", None) is not None:  # host rows
            stored = self.engine.offload.receive(received.hashes, rows)
            received = None
        elif rows is not None:  # host rows, no transfer tier (a tensor-parallel engine): written at the step boundary
            import torch

            with warnings.catch_warnings():  # Ray's object store hands read-only arrays: only read here
                warnings.simplefilter("ignore", UserWarning)
                received = replace(received, rows=torch.from_numpy(rows))
        done = threading.Event()
        box: list = [None, 0]
        with self._lock:
            self._cmds.append(("add", (request_id, prompt_token_ids, params, priority, cache_salt, export, transfer,
                                       received, segment_spans, multi_modal_data), done, box))
            self._changed.notify_all()
        done.wait()
        if box[0] is not None:
            raise box[0]
        return stored + box[1]

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._cmds.append(("abort", request_id, None, None))
            self._changed.notify_all()

    def poll(self, timeout_s: float = 0.5) -> PollResult:
        """Wait up to ``timeout_s`` for news; return everything since the last poll."""
        end = time.monotonic() + timeout_s
        with self._lock:
            while not (self._outputs or self._failed or self._events) and not self._stop:
                left = end - time.monotonic()
                if left <= 0:
                    break
                self._changed.wait(left)
            res = PollResult([self._encoder.encode(o) for o in self._outputs.values()], self._failed,
                             self._events, self._load, self._stats)
            self._outputs, self._failed, self._events = {}, {}, []
        return res

    def take_export(self, request_id: str, skip: int = 0) -> ExtractedBlocks:
        """The prompt blocks ``add(..., export=...)`` kept when ``request_id`` finished, after
        the first ``skip`` (``BlockExports.take``: no step boundary to wait for)."""
        return self.exports.take(request_id, skip)

    def transfer_done(self, nbytes: int) -> None:
        """The front end's word that ``nbytes`` of shared device rows were received (or given up)."""
        self.exports.done(nbytes)

    def pin(self, prompt_token_ids: list[int], ttl_s: float | None, cache_salt: str | None) -> PinInfo:
        """Compute and pin a prefix (``LLMEngine.pin_prefix``); returns once it is pinned.
        Raises ``ValueError`` (naming the field) if the engine refuses it."""
        done = threading.Event()
        box: list = [None]

        def on_done(result) -> None:
            box[0] = result if isinstance(result, Exception) else PinInfo.of(result, time.monotonic())
            done.set()

        self._call(lambda: self.engine.pin_prefix({"prompt_token_ids": prompt_token_ids}, ttl_s, cache_salt,
                                                  on_done=on_done))
        done.wait()
        if isinstance(box[0], Exception):
            raise box[0]
        return box[0]

    def list_pins(self, pin_ids: set[str]) -> list[PinInfo]:
        return self._call(lambda: self.engine.pin_infos(pin_ids))

    def unpin(self, pin_id: str) -> bool:
        return self._call(lambda: self.engine.unpin_prefix(pin_id))

    def snapshot(self) -> KVSnapshot:
        """Every cached hash now (for a subscriber that missed a batch); runs on the stepping
        thread between steps, so it matches the batches numbered up to its ``seq``."""
        return self._call(self.engine.kv_event_snapshot)

    def stats(self) -> dict:
        return {**self._call(self.engine.stats), "pid": os.getpid()}

    def top_prefixes(self, n: int = 10) -> list[dict]:
        """``LLMEngine.top_prefixes`` on the stepping thread, between steps."""
        return self._call(lambda: self.engine.top_prefixes(n))

    def ping(self) -> str:
        return self.engine_id

    def placement(self) -> dict:
        """Where this engine runs (``ray_cluster.where_am_i``: host, Ray node, GPUs), its device
        and its tensor-parallel size."""
        from kvos.distributed.ray_cluster import where_am_i

        return {**where_am_i(), "device": str(self.engine.runner.device),
                "tensor_parallel_size": self.engine.config.tensor_parallel_size}

    def shutdown(self) -> None:
        with self._lock:
            self._stop = True
            self._changed.notify_all()
        self._thread.join(10)
        self.engine.shutdown()  # a tensor-parallel engine's rank processes

    # -- the stepping thread -------------------------------------------------------------
    def _call(self, fn):
        done = threading.Event()
        box: list = [None, None]
        with self._lock:
            self._cmds.append(("call", fn, done, box))
            self._changed.notify_all()
        done.wait()
        if box[1] is not None:
            raise box[1]
        return box[0]

    def _apply(self, cmds: list[tuple]) -> None:
        e = self.engine
        for kind, arg, done, box in cmds:
            if kind == "add":
                rid, ids, params, priority, salt, export, transfer, received, spans, mm = arg
                if received is not None and received.hashes:
                    try:
                        box[1] = e.adopt_blocks(received.hashes, received.parent, received.rows, received.depth)
                    except Exception:  # the request computes the blocks itself
                        log.exception("%s: receiving %s's blocks failed", self.engine_id, rid)
                try:
                    prompt = {"prompt_token_ids": ids, "segment_spans": spans}
                    if mm is not None:
                        prompt["multi_modal_data"] = mm
                    e.add_request(prompt, params, request_id=rid,
                                  priority=priority,
                                  cache_salt=salt)
                    if export:
                        self.exports.expect(rid, export, transfer)
                except Exception as err:  # a bad request never stops the engine
                    box[0] = err
                done.set()
            elif kind == "release":
                e.kv.pool.free_blocks(reversed(arg))
            elif kind == "call":
                try:
                    box[0] = arg()
                except Exception as err:
                    box[1] = err
                done.set()
            else:
                e.abort_request(arg)
                self.exports.hold(arg)
                self._aborted.append(arg)

    def _release_blocks(self, blocks) -> None:
        """Any thread: drop references on the stepping thread (``BlockExports``)."""
        with self._lock:
            self._cmds.append(("release", blocks, None, None))
            self._changed.notify_all()

    def _run(self) -> None:
        e = self.engine
        while True:
            with self._lock:
                while not self._cmds and not e.has_unfinished_requests() and not self._stop:
                    self._changed.wait(0.5)
                if self._stop:
                    return
                cmds, self._cmds = self._cmds, []
            self._apply(cmds)
            outputs: list[RequestOutput] = []
            failed: dict[str, str] = {}
            if e.has_unfinished_requests():
                try:
                    outputs = e.step()
                except Exception as err:  # the step's requests fail; the engine goes on
                    log.exception("%s: step failed; failing its requests", self.engine_id)
                    for rid in e.request_ids():
                        e.abort_request(rid)
                        failed[rid] = f"engine error: {err}"
            if self.exports.pending:
                for out in outputs:
                    if out.finished:
                        self.exports.hold(out.request_id)
                for rid in failed:
                    self.exports.hold(rid)
                self.exports.release_expired(time.monotonic())
            batch = e.drain_kv_events() if e.kv_events is not None else None
            load = e.scheduler.load()
            now = time.monotonic()
            stats = None
            if now - self._stats_at >= self.STATS_EVERY_S or not e.has_unfinished_requests():
                stats, self._stats_at = {**e.stats(), "pid": os.getpid()}, now
            with self._lock:
                for out in outputs:
                    self._outputs[out.request_id] = out
                for rid in (*self._aborted, *failed):  # no output of theirs comes any more
                    self._outputs.pop(rid, None)
                    self._encoder.forget(rid)
                self._aborted.clear()
                self._failed.update(failed)
                if batch is not None:
                    self._events.append(batch)
                    del self._events[: -self.MAX_EVENT_BATCHES]
                self._load = load
                if stats is not None:
                    self._stats = stats
                if outputs or failed or batch is not None:
                    self._changed.notify_all()
