"""What the runner needs to run one step, as plain picklable data: no ``Request``, no ``KVBlock``.

The scheduler owns live objects (requests, block tables); ``describe_step`` copies out of them,
on the engine thread right after ``Scheduler.schedule``, exactly what the model runner reads, so
that a step can run in another process (an engine actor, a worker per GPU). Within one process
the lists may be shared with the requests (no copy): they are read before the step's output is
applied, which is the only time they change.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvos.core.media import MediaItem
from kvos.core.sampling_params import SamplingParams


@dataclass(slots=True)
class SampleTarget:
    """One sampled token for ``request_id`` from its sequence's last logits row this step."""

    request_id: str
    params: SamplingParams
    sample_index: int
    """The fork's index (``n > 1``): a seeded request's fork ``i`` draws its own stream."""
    prev_pending: int
    """Tokens sampled by the step before and not yet delivered (0 or 1, async scheduling)."""
    output_ids: list[int] | None = None
    """The delivered generated tokens (penalties need the history), else None."""
    prompt_ids: list[int] | None = None
    """The prompt (repetition penalty only), else None."""
    ban_ids: list[int] | None = None
    """Tokens that may not be sampled (stop and EOS ids before ``min_tokens``; bad words' last
    tokens whose preceding tokens end the output)."""
    ban_after: list[tuple[int, int]] | None = None
    """(token, previous): ``token`` may not be sampled if the token the step before sampled (still
    on the device: ``prev_pending`` is 1) is ``previous`` (a bad word whose other tokens end the
    delivered output)."""


@dataclass(slots=True)
class StepSeq:
    """Tokens ``[start, start + num_new_tokens)`` of ``request_id``."""

    request_id: str
    start: int
    num_new_tokens: int
    token_ids: list[int]
    """The known input tokens; one shorter than ``num_new_tokens`` when the last is the token
    the previous step sampled, still on the device (async scheduling)."""
    block_ids: list[list[int]]
    """Per cache group, the sequence's block table (every group's is as long)."""
    samplers: list[SampleTarget] = field(default_factory=list)
    prompt_logprobs: tuple[int, list[int]] | None = None
    """(k, the prompt tokens at positions ``start + 1 ...`` that this chunk's rows score)."""
    draft_token_ids: list[int] = field(default_factory=list)
    """Speculative decoding: the last tokens of ``token_ids`` are these drafts; the one sampling
    target gets the accepted drafts and one token of its own, from the logits of the last
    ``len(draft_token_ids) + 1`` positions."""
    media: list[MediaItem] = field(default_factory=list)
    """The images with a position in this chunk (each whole, with its pixels)."""


@dataclass(slots=True)
class SegmentCopy:
    """Reused segment KV: slot ``src_slots[i]`` (flat ``block * block_size + offset``) of cache
    group ``group`` goes to ``dst_slots[i]``, its keys rotated forward by ``delta`` positions
    (the destination's position minus the source's) with each layer's own rotary table. Runs
    after the copy-on-write copies and before the forward pass."""

    group: int
    src_slots: list[int]
    dst_slots: list[int]
    delta: int


@dataclass(slots=True)
class StepDescription:
    seqs: list[StepSeq]
    copies: list[tuple[int, int, int]]
    """(cache group, src block, dst block): copy-on-write copies before the forward pass."""
    finished_ids: list[str]
    """Requests that ended since the last step (the runner drops their generators)."""
    segment_copies: list[SegmentCopy] = field(default_factory=list)
    encodings: dict[str, tuple[bool, list[int]]] = field(default_factory=dict)
    """Image key -> (cached, slots of the pool's encoder group): a cached encoding is read from
    its slots, a new one written to them after it is encoded (no slots: not kept). An image of
    the step without an entry is encoded and not kept."""

    @property
    def is_empty(self) -> bool:
        return not self.seqs
