"""What the runner needs to run one step, as plain picklable data: no ``Request``, no ``KVBlock``.

The scheduler owns live objects (requests, block tables); ``describe_step`` copies out of them,
on the engine thread right after ``Scheduler.schedule``, exactly what the model runner reads, so
that a step can run in another process (an engine actor, a worker per GPU). Within one process
the lists may be shared with the requests (no copy): they are read before the step's output is
applied, which is the only time they change.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvos.engine.sampling_params import SamplingParams
from kvos.engine.scheduler import ScheduledSeq, SchedulerOutput


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
    """Tokens that may not be sampled yet (stop and EOS ids before ``min_tokens``)."""


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


@dataclass(slots=True)
class StepDescription:
    seqs: list[StepSeq]
    copies: list[tuple[int, int, int]]
    """(cache group, src block, dst block): copy-on-write copies before the forward pass."""
    finished_ids: list[str]
    """Requests that ended since the last step (the runner drops their generators)."""

    @property
    def is_empty(self) -> bool:
        return not self.seqs


def _target(req) -> SampleTarget:
    sp = req.sampling_params
    prev = req.num_pending - 1  # this step's sample is already counted as pending
    t = SampleTarget(req.request_id, sp, req.sample_index, prev)
    if sp.needs_history:
        t.output_ids = req.output_token_ids
        if sp.repetition_penalty != 1.0:
            t.prompt_ids = req.prompt_token_ids
    if len(req.output_token_ids) + prev + 1 < sp.min_tokens:
        ban = list(sp.stop_token_ids or ())
        if not sp.ignore_eos:
            ban.extend(req.eos_token_ids)
        t.ban_ids = ban or None
    return t


def _seq(s: ScheduledSeq) -> StepSeq:
    req = s.request
    end = s.start + s.num_new_tokens
    plp = None
    k = req.sampling_params.prompt_logprobs
    if k is not None:
        prompt = req.prompt_token_ids
        hi = min(end, len(prompt) - 1)
        if hi > s.start:
            plp = (k, prompt[s.start + 1: hi + 1])
    return StepSeq(req.request_id, s.start, s.num_new_tokens, req.all_token_ids[s.start: end],
                   [[b.block_id for b in t] for t in s.tables], [_target(r) for r in s.samplers], plp)


def describe_step(out: SchedulerOutput) -> StepDescription:
    """The runner's view of ``out``; call before the next ``schedule`` or output update."""
    return StepDescription([_seq(s) for s in out.seqs], list(out.copies), list(out.finished_ids))
