"""Segment reuse: a prompt's segments (documents, chat messages) take their KV from the same
tokens computed alone, wherever they sit in the prompt. Pure Python (no torch).

A segment ``[s, e)`` of a prompt is cached as the *source chain* ``header + prompt[s:e]``: the
model's header (the tokens its tokenizer puts before every prompt, e.g. BOS) then the segment,
computed from position 0 and registered in the prefix cache like any prompt (same root: model
and tenant salt, so tenants never share a segment). A source's full blocks hold the KV of the
segment's first ``k * block_size - len(header)`` tokens.

A later request whose segment's source is cached recomputes the segment's first
``ceil(recompute * n)`` reusable tokens (n of them) and takes the rest, ``ReuseSpan``, from the
source: slot by slot, its keys rotated forward by ``s - len(header)`` positions. Recomputing a
segment's head is the rule of EPIC (Hu et al., 2025): tokens computed alone attend mostly to
their segment's first tokens (an attention sink), so those are where the reused KV is furthest
from what full prefill computes; every later token of the prompt attends to the recomputed
head. ``recompute=1`` reuses nothing (exact); ``0`` reuses every full block.

Invariants: a request's KV from its first reused token on is approximate, so its
``exact_tokens`` stops the KV manager from registering those blocks (the prefix cache only ever
holds exact KV); a span's sources are referenced (``KVCacheManager.borrow``) from planning until
the step that copies them has run.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from kvos.cache.block import BlockHash, KVBlock
from kvos.cache.hashing import extend_block_hashes, root_hash
from kvos.cache.kv_manager import KVCacheManager
from kvos.core.request import Request
from kvos.core.sampling_params import SamplingParams
from kvos.core.step import SegmentCopy

SEGMENT_HEADERS = ("model", "first_segment")
"""What a segment's source chain starts with: ``model``, the tokenizer's prefix of every prompt
(BOS, or nothing), so a segment is reused whatever precedes it; ``first_segment``, the prompt's
first segment (a system prompt, a RAG instruction), so a segment is reused only after the same
first segment, with KV that attended to it."""


@dataclass
class ReuseSpan:
    """Prompt positions ``[start, end)`` filled from a cached source chain whose position
    ``src_start`` holds ``start``'s token; ``sources`` are the chain's blocks per cache group
    (null placeholders where a sliding group needs none), borrowed by the request;
    ``recomputed``: the segment's tokens before ``start`` that the request computes (its head,
    less what the prefix cache or a lower tier served)."""

    start: int
    end: int
    src_start: int
    sources: list[list[KVBlock]]
    recomputed: int = 0

    @property
    def length(self) -> int:
        return self.end - self.start


class SegmentReuse:
    """Plans fills and reuse for requests with ``segments`` (``Scheduler`` with
    ``segment_reuse``). ``header``: the tokens every source chain starts with."""

    def __init__(self, kv: KVCacheManager, recompute: float, header: list[int] | None = None,
                 header_mode: str = "model") -> None:
        if header_mode not in SEGMENT_HEADERS:
            raise ValueError(f"segment_header must be one of {SEGMENT_HEADERS}, got {header_mode!r}")
        self.kv = kv
        self.recompute = recompute
        self.header = list(header or [])
        """The model's header (the tokenizer's prefix of every prompt): the engine sets it."""
        self.header_mode = header_mode
        self._filling: dict[BlockHash, str] = {}  # a pending fill's last full-block hash -> its id

    def header_of(self, req: Request) -> list[int]:
        """The tokens ``req``'s source chains start with: the model's header, or (mode
        ``first_segment``) the prompt's first segment when it starts the prompt."""
        if self.header_mode == "first_segment" and req.segments and req.segments[0][0] == 0:
            return req.prompt_token_ids[: req.segments[0][1]]
        return self.header

    def _source(self, req: Request, start: int, end: int) -> tuple[list[int], list[BlockHash]]:
        chain = self.header_of(req) + req.prompt_token_ids[start:end]
        hashes: list[BlockHash] = []
        extend_block_hashes(hashes, chain, self.kv.block_size, root_hash(self.kv.model_id, req.cache_salt))
        return chain, hashes

    def fills(self, req: Request) -> list[Request]:
        """Prefill-only requests that compute and cache ``req``'s segments not cached yet (one
        per source, however many requests carry it). None for a segment the request's own
        prefix computes the same way (right after the header at the prompt's start), nor for the
        last segment: the newest message or the question, rarely seen again elsewhere (a
        conversation's next turn finds it in its exact prefix)."""
        if not self.kv.enable_caching:
            return []
        out = []
        for i, (start, end) in enumerate(req.segments[:-1]):
            if self._at_start(req, start):
                continue
            chain, hashes = self._source(req, start, end)
            if not hashes or hashes[-1] in self._filling:
                continue
            if len(self.kv.prefix_blocks(hashes, len(hashes))[0]) == len(hashes):
                continue
            fill = Request(f"{req.request_id}#segment{i}", chain, SamplingParams(max_tokens=1, temperature=0),
                           priority=req.priority, cache_salt=req.cache_salt, max_model_len=req.max_model_len,
                           prefill_only=True)
            self._filling[hashes[-1]] = fill.request_id
            out.append(fill)
        return out

    def _at_start(self, req: Request, start: int) -> bool:
        """A segment at the prompt's start (from position 0, or right after the header there):
        the request's own prefix computes it, and the prefix cache serves it."""
        header = self.header_of(req)
        h = len(header)
        return start == 0 or (start == h and req.prompt_token_ids[:h] == header)

    def fill_done(self, fill: Request) -> None:
        self._filling = {k: v for k, v in self._filling.items() if v != fill.request_id}

    def plan(self, req: Request, computed: int) -> list[ReuseSpan]:
        """The spans of ``req`` to reuse after its ``computed`` exact tokens, their sources
        borrowed; sets ``req.reuse_spans`` and ``req.exact_tokens``. A segment's head (its
        first ``ceil(recompute * n)`` reusable tokens) is always exact: computed, or served by
        the prefix cache. A segment the prefix cache served in part (an earlier request with the
        same tokens before it registered its exact blocks up to its first reused token) is
        reused from ``computed`` on, past its head; one it served whole is left alone. No span
        reaches the prompt's last token (its logits are computed). ``computed`` is a whole number
        of blocks (prefix hits and tier loads are), so no span writes into a block the request
        shares with the prefix cache."""
        bs, h = self.kv.block_size, len(self.header_of(req))
        assert computed % bs == 0, computed
        spans: list[ReuseSpan] = []
        last = req.num_prompt_tokens - 1
        for start, end in req.segments:
            if end <= computed or start >= last or self._at_start(req, start):
                continue
            _, hashes = self._source(req, start, end)
            bound = min(len(hashes), (last - start + h) // bs)
            hits = self.kv.prefix_blocks(hashes, bound)
            n = len(hits[0]) * bs - h  # segment tokens the source's cached blocks hold
            if n <= 0:
                continue
            first = max(start + math.ceil(self.recompute * n), computed)  # past the head and the exact prefix
            if first >= start + n:
                continue
            self.kv.borrow(req.request_id, hits)
            spans.append(ReuseSpan(first, start + n, h + first - start, hits, first - max(start, computed)))
        req.reuse_spans = spans
        req.exact_tokens = spans[0].start if spans else None
        return spans

    def drop(self, req: Request) -> None:
        """Forget ``req``'s plan (its borrowed sources are released by the KV manager's free)."""
        req.reuse_spans = []

    @staticmethod
    def chunk(req: Request, pos: int, budget: int) -> tuple[list[tuple[int, int]], int]:
        """What ``req``, computed up to ``pos``, does in one step of ``budget`` tokens: the
        ranges ``(start, num_tokens)`` it computes, in order, with the spans between them
        reused (a span right at ``pos`` first); and how many of its spans that reuses. Every
        range ends at a span or within the budget; at least one token is computed."""
        spans, ranges, i = req.reuse_spans, [], 0
        while budget > 0:
            while i < len(spans) and spans[i].start == pos:
                pos = spans[i].end
                i += 1
            stop = spans[i].start if i < len(spans) else req.num_tokens
            n = min(stop - pos, budget)
            ranges.append((pos, n))
            budget -= n
            pos += n
            if pos < stop or i == len(spans):
                break
        return ranges, i

    def copies(self, req: Request, spans: list[ReuseSpan]) -> list[SegmentCopy]:
        """The slot copies that fill ``spans`` into ``req``'s blocks (allocated by now), per
        group; slots whose source or destination is a null placeholder (a sliding group's
        blocks behind every later token's window) are skipped."""
        bs = self.kv.block_size
        tables = self.kv.block_tables(req.request_id)
        out = []
        for span in spans:
            delta = span.start - span.src_start
            for g, (sources, table) in enumerate(zip(span.sources, tables)):
                src, dst = [], []
                for i in range(span.length):
                    s_pos, d_pos = span.src_start + i, span.start + i
                    sb, db = sources[s_pos // bs], table[d_pos // bs]
                    if sb.is_null or db.is_null:
                        continue
                    src.append(sb.block_id * bs + s_pos % bs)
                    dst.append(db.block_id * bs + d_pos % bs)
                if src:
                    out.append(SegmentCopy(g, src, dst, delta))
        return out
