"""``describe_step``: the scheduler's live output copied into the plain ``StepDescription`` the
runner reads. Call on the engine thread right after ``Scheduler.schedule``, before the step's
output is applied."""
from __future__ import annotations

from collections.abc import Iterable

from kvos.cache.encoder_pages import EncoderPages
from kvos.core.media import MediaItem, media_overlapping
from kvos.core.step import SampleTarget, StepDescription, StepSeq
from kvos.scheduler.scheduler import ScheduledSeq, SchedulerOutput


def bad_word_bans(words: list[list[int]], output: list[int], pending: int) -> tuple[list[int], list[tuple[int, int]]]:
    """The next token's bans from bad words' token sequences, given the delivered ``output`` and
    ``pending`` (0 or 1) more generated tokens still on the device: a word's last token is banned
    where the generated tokens end with its other tokens. Returns (tokens banned outright,
    (token, previous) pairs banned if the pending token is ``previous``)."""
    ban: list[int] = []
    ban_after: list[tuple[int, int]] = []
    n = len(output)
    for ids in words:
        k = len(ids) - 1  # the prefix's length
        if k == 0:
            ban.append(ids[0])
        elif pending == 0:
            if n >= k and output[n - k:] == ids[:-1]:
                ban.append(ids[-1])
        elif n >= k - 1 and output[n - k + 1:] == ids[:-2]:  # the pending token must be the prefix's last
            ban_after.append((ids[-1], ids[-2]))
    return ban, ban_after


def _target(req) -> SampleTarget:
    sp = req.sampling_params
    prev = req.num_pending - 1  # this step's sample is already counted as pending
    t = SampleTarget(req.request_id, sp, req.sample_index, prev)
    if sp.needs_history:
        t.output_ids = req.output_token_ids
        if sp.repetition_penalty != 1.0:
            t.prompt_ids = req.prompt_token_ids
    ban: list[int] = []
    if len(req.output_token_ids) + prev + 1 < sp.min_tokens:
        ban.extend(sp.stop_token_ids or ())
        if not sp.ignore_eos:
            ban.extend(req.eos_token_ids)
    if sp.bad_words:
        words, after = bad_word_bans(sp.bad_words_token_ids, req.output_token_ids, prev)
        ban.extend(words)
        t.ban_after = after or None
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
    drafts = s.draft_token_ids
    tokens = req.all_token_ids[s.start: end - len(drafts)] + drafts if drafts else req.all_token_ids[s.start: end]
    return StepSeq(req.request_id, s.start, s.num_new_tokens, tokens,
                   [[b.block_id for b in t] for t in s.tables], [_target(r) for r in s.samplers], plp,
                   list(drafts), media_overlapping(req.media, s.start, end) if req.media else [])


def _earlier(s: ScheduledSeq) -> list[StepSeq]:
    """A segment-reusing request's earlier ranges this step: sequences of their own (no samples)."""
    req, k = s.request, s.request.sampling_params.prompt_logprobs
    tables = [[b.block_id for b in t] for t in s.tables]
    out = []
    for start, n in s.earlier:
        plp = (k, req.prompt_token_ids[start + 1: start + n + 1]) if k is not None else None
        out.append(StepSeq(req.request_id, start, n, req.all_token_ids[start: start + n], tables, [], plp))
    return out


def describe_step(out: SchedulerOutput) -> StepDescription:
    """The runner's view of ``out``; call before the next ``schedule`` or output update."""
    seqs = []
    for s in out.seqs:
        if s.earlier:
            seqs += _earlier(s)
        seqs.append(_seq(s))
    return StepDescription(seqs, list(out.copies), list(out.finished_ids), list(out.segment_copies))


def plan_encodings(cache: EncoderPages, media: Iterable[MediaItem], nbytes: int) -> dict[str, tuple[bool, list[int]]]:
    """Where each image of a step (``media``: its sequences' items) reads or writes its encoding:
    key -> (cached, slots). A cached one is read from its slots; a new one is encoded and written
    to the slots reserved for it (none when the cache cannot hold it: encoded, not kept). Entries
    the step reads stay pinned while later ones are reserved, so a reservation never evicts what
    this step reads."""
    out: dict[str, tuple[bool, list[int]]] = {}
    try:
        for m in media:
            if m.key in out:
                continue
            slots = cache.lookup(m.key)
            if slots is not None:
                cache.pin(m.key)
                out[m.key] = (True, slots)
            else:
                out[m.key] = (False, cache.reserve(m.key, nbytes) or [])
    finally:
        cache.unpin_all()
    return out
