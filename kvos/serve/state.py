"""What one server holds across requests: its engine, tokenizers, tenants, metrics and drain state."""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import logging
import time

import kvos
from kvos.engine.client import EngineClient
from kvos.engine.media import ImagePreparer, MediaLimits
from kvos.serve.errors import APIError
from kvos.serve.limits import (
    DEFAULT_SHUTDOWN_TIMEOUT_S,
    TokenizerPool,
    max_token_bytes,
    min_prompt_tokens,
)
from kvos.serve.metrics import ServerMetrics
from kvos.serve.responses import LogprobFormatter, system_fingerprint

log = logging.getLogger("kvos.serve")


class ServerState:
    """``engine``: any ``EngineClient`` (in-process, process, Ray or data-parallel); the server
    starts and shuts it down (``create_app``'s lifespan)."""

    def __init__(self, engine: EngineClient, model_name: str, api_keys: list[str], max_waiting: int,
                 shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S) -> None:
        self.engine = engine
        self.model_name = model_name
        self.api_keys = {k: hashlib.sha256(k.encode()).hexdigest()[:32] for k in api_keys}
        self.max_waiting = max_waiting
        self.metrics = ServerMetrics(self._stats)
        # fast tokenizers are not thread-safe: the event loop gets its own instance, the engine
        # thread keeps the engine's. None: token ids in and out (``require_tokenizer``)
        self.tokenizer = copy.deepcopy(engine.tokenizer)
        # prompts are tokenized on worker threads (each its own copy), never on the event loop or
        # the engine thread; ``token_bytes`` bounds a text's token count from below by its size
        self.tokenizers = None if self.tokenizer is None else TokenizerPool(engine.tokenizer, copy.deepcopy)
        self.token_bytes = None if self.tokenizer is None else max_token_bytes(self.tokenizer)
        self.shutdown_timeout_s = shutdown_timeout_s
        self.num_tokenizing = 0  # sequences admitted and being tokenized (not yet in num_pending)
        self.logprobs = LogprobFormatter(self.tokenizer)
        self.tool_call_parser: str | None = None
        """How tool calls are read from replies (``--tool-call-parser``); None: from the template."""
        self.media: ImagePreparer | None = None  # made on the first request with an image
        self.ready = False
        self.draining = False
        self.created = int(time.time())
        self.pin_tenants: dict[str, str | None] = {}  # pin id -> the API-key tenant that made it
        facts = engine.model_facts
        self.max_model_len: int = facts.max_model_len
        self.segment_reuse: bool = facts.segment_reuse
        self.vocab_size: int = facts.vocab_size
        self.default_sampling: dict = dict(facts.default_sampling)
        self.fingerprint = system_fingerprint(kvos.__version__, facts.model_id, facts.dtype, facts.device)

    def require_media(self, images: list) -> ImagePreparer | None:
        """The image preparer when a chat holds ``images``: 400 naming ``messages`` when the model
        takes none, or naming the part past ``--limit-images-per-prompt``."""
        if not images:
            return None
        facts = self.engine.model_facts
        if facts.vision is None:
            raise APIError(400, "messages: this model takes no images", param="messages")
        if self.media is None:  # a client never names a file on the server's disk
            limits = dataclasses.replace(facts.media_limits or MediaLimits(), allow_files=False)
            self.media = ImagePreparer(facts.vision, facts.media_folder, limits)
        limit = self.media.limits.max_images
        if len(images) > limit:
            where = images[limit][0]
            raise APIError(400, f"{where}: at most {limit} images per prompt (--limit-images-per-prompt)",
                           param=where)
        return self.media

    def require_tokenizer(self, param: str) -> None:
        """400 naming ``param`` when this server has no tokenizer (``--skip-tokenizer-init``, or a
        model without tokenizer files): only token-id prompts to ``/v1/completions`` work then."""
        if self.tokenizer is None:
            raise APIError(400, f"{param}: this server has no tokenizer (--skip-tokenizer-init, or a model without "
                                f"tokenizer files); send prompts as token ids to /v1/completions",
                           param=param, code="tokenizer_unavailable")

    def model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "kvos",
                "root": self.model_name, "parent": None, "max_model_len": self.max_model_len}

    def _stats(self) -> dict:
        s = self.engine.stats()
        # not started: in an engine's queue, on the way there, or being tokenized (num_pending would
        # count the engine's queue twice and running prefills as waiting)
        s["waiting"] += self.engine.num_queued + self.num_tokenizing
        return s

    @contextlib.contextmanager
    def tokenizing(self, num_seqs: int):
        """Count ``num_seqs`` admitted sequences as waiting while their prompts are tokenized (so
        backpressure sees them before they reach the engine)."""
        self.num_tokenizing += num_seqs
        try:
            yield
        finally:
            self.num_tokenizing -= num_seqs

    async def drain(self) -> None:
        """Graceful shutdown, idempotent: from now on ``/health`` is 503 and new work gets 503;
        requests in flight get up to ``shutdown_timeout_s`` to finish, then are cut (a stream ends
        with an error event and ``[DONE]``, a plain request gets 503)."""
        self.draining = True
        await self.engine.drain(timeout=self.shutdown_timeout_s)
        if self.engine.num_in_flight:
            n = await self.engine.cut_all(f"the server shut down before this request finished "
                                          f"(--shutdown-timeout-s {self.shutdown_timeout_s:g})")
            log.warning("shutdown deadline (%ss) reached; cut %d requests", self.shutdown_timeout_s, n)

    def check_fits(self, text: str, param: str) -> None:
        """400 naming ``param`` when ``text`` cannot fit the context whatever it tokenizes to
        (its size alone proves it is at least ``max_model_len`` tokens); nothing is tokenized."""
        n = min_prompt_tokens(text, self.token_bytes)
        if n >= self.max_model_len:
            raise APIError(400, f"{param} is too long: its {len(text.encode('utf-8', 'surrogatepass'))} bytes are at "
                                f"least {n} tokens (a token is at most {self.token_bytes} bytes); max_model_len is "
                                f"{self.max_model_len}, which leaves no room for output", param=param,
                           code="context_length_exceeded")
