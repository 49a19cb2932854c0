"""A request as the scheduler and the KV memory system see it. Pure Python."""
from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

from kvos.core.media import MediaItem
from kvos.core.sampling_params import SamplingParams

_arrivals = itertools.count()


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    LOADING = "loading"  # admitted; its prefix is being loaded from a tier below the device
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # a step failed while computing it (vLLM's name); never a sampling outcome

    finished: bool
    """Whether the request ended (a plain attribute: read for every request on every step)."""


for _status in RequestStatus:
    _status.finished = _status.value in ("stop", "length", "abort", "error")


@dataclass(eq=False)
class Request:
    """One sequence: a prompt, its outputs so far, and how far its KV has been computed.

    ``parent_id`` groups the ``n`` sequences of one user request (index ``sample_index``).
    ``arrival`` orders requests first come, first served (a child inherits its parent's).
    ``num_pending``: tokens of scheduled steps whose output has not been applied yet (with
    async scheduling the step may still be running on the device), ids unknown to the host. They count in ``num_tokens`` (the next step computes
    them, fed on the device) but are not in ``all_token_ids``/``output_token_ids`` until
    ``append_token`` delivers them, oldest first.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    priority: int = 0
    cache_salt: str | None = None
    max_model_len: int = 1 << 30
    parent_id: str | None = None
    sample_index: int = 0
    arrival: int = field(default_factory=lambda: next(_arrivals))
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    max_computed_tokens: int = 0
    num_cached_tokens: int = -1
    prompt_hit_tokens: int = 0
    """Prompt tokens the device cache held when the request arrived: its load estimate for
    routers (``Scheduler.load``); admission looks the hit up again."""
    cached_by_source: dict[str, int] = field(default_factory=dict)
    num_preemptions: int = 0
    swapped_tokens: int = 0  # > 0 while its KV waits in host memory (preemption by swap)
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    forked: bool = False
    num_pending: int = 0
    queued_at_step: int = 0  # the scheduler step at which it last joined the waiting queue
    draft_token_ids: list[int] = field(default_factory=list)
    """Speculative decoding: tokens proposed to follow ``all_token_ids``, set before a schedule
    and consumed by it (scheduled for verification, or dropped); never counted in
    ``num_tokens`` and never in the prefix cache until the target accepts them."""
    segments: tuple[tuple[int, int], ...] = ()
    """Segment reuse: prompt spans ``[start, end)``, in order and disjoint, whose KV may come
    from the same tokens computed alone after the model's header (``Scheduler`` with
    ``segment_reuse``), wherever they sit in the prompt."""
    prefill_only: bool = False
    """Computes its prompt's KV (cached like any prompt's) and finishes without sampling: the
    fill of a segment that was not cached yet."""
    exact_tokens: int | None = None
    """KV from this position on is approximate (built on reused segments): the KV manager never
    registers it in the prefix cache. None: every computed token's KV is exact."""
    reuse_spans: list = field(default_factory=list)
    """The scheduler's pending ``ReuseSpan``s (segment reuse), in prompt order."""
    media: tuple[MediaItem, ...] = ()
    """The prompt's images, in order and disjoint (``kvos.core.media``)."""

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)
        if self.parent_id is None:
            self.parent_id = self.request_id

    @property
    def num_tokens(self) -> int:
        """Known tokens plus pending ones."""
        return len(self.all_token_ids) + self.num_pending

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def needs_all_prompt_positions(self) -> bool:
        """True when every prompt position must be computed here (prompt logprobs): the request
        takes no prefix-cache or tier hits."""
        return self.sampling_params.prompt_logprobs is not None

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_token(self, token_id: int) -> None:
        """Deliver the next output token (the oldest pending one, if any is pending)."""
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.num_pending:
            self.num_pending -= 1

    def length_reached_with_pending(self) -> bool:
        """True when the tokens already sampled (pending ones included) reach ``max_tokens`` or
        ``max_model_len``: the sequence will finish once they are delivered, so it must not be
        scheduled again."""
        sp = self.sampling_params
        return ((sp.max_tokens is not None and len(self.output_token_ids) + self.num_pending >= sp.max_tokens)
                or self.num_tokens >= self.max_model_len)

    def check_stop(self) -> RequestStatus | None:
        """Token-level stop after the last appended token (stop strings are the engine's)."""
        sp = self.sampling_params
        last = self.output_token_ids[-1]
        if self.num_output_tokens >= sp.min_tokens:
            if not sp.ignore_eos and last in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if last in sp.stop_token_ids:  # type: ignore[operator]
                self.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if sp.max_tokens is not None and self.num_output_tokens >= sp.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if len(self.all_token_ids) >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def fork(self, index: int) -> Request:
        """A sibling sequence sharing this one's prompt and progress (for ``n > 1``)."""
        return Request(
            request_id=f"{self.request_id}#{index}", prompt_token_ids=self.prompt_token_ids,
            sampling_params=self.sampling_params, eos_token_ids=self.eos_token_ids,
            priority=self.priority, cache_salt=self.cache_salt, max_model_len=self.max_model_len,
            parent_id=self.parent_id, sample_index=index, arrival=self.arrival,
            all_token_ids=list(self.all_token_ids), num_computed_tokens=self.num_computed_tokens,
            num_cached_tokens=self.num_cached_tokens, status=self.status, forked=True,
            segments=self.segments, exact_tokens=self.exact_tokens, media=self.media)
