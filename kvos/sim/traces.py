"""Workloads for the simulator: Mooncake JSONL, ShareGPT-like lengths, synthetic generators.

Prompts are synthetic token ids. In a Mooncake trace each 512-token block with hash id ``h`` is
``[h] * 512``, so equal hash ids give equal content and the engine's own chained hashes match
exactly where the trace's do.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

MOONCAKE_BLOCK = 512
IMAGE_TOKEN = -9
"""The placeholder id of an image's positions (the image's key tells images apart)."""


@dataclass
class TraceRequest:
    """One request: arrival time (s), lengths, and what its prompt shares with others.

    ``hash_ids``: Mooncake chained ids of 512-token prompt blocks. ``segments``: alternative
    content description, a list of (content id, length) pieces (shared system prompts, sessions).
    """

    arrival_s: float
    input_len: int
    output_len: int
    hash_ids: list[int] | None = None
    segments: list[tuple[int, int]] | None = None
    images: list[tuple[int, int, int]] | None = None
    """(offset, length, image id): the prompt's images; their positions hold ``IMAGE_TOKEN``."""

    def prompt_tokens(self, index: int) -> list[int]:
        if self.hash_ids is not None:
            toks: list[int] = []
            for i, h in enumerate(self.hash_ids):
                toks += [h] * min(MOONCAKE_BLOCK, self.input_len - i * MOONCAKE_BLOCK)
            return toks
        if self.segments is not None:
            toks = []
            for content, n in self.segments:
                toks += [content] * n
            return toks[: self.input_len]
        return [-(index + 1)] * self.input_len  # unique content


def load_mooncake(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    import gzip

    reqs = []
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        for line in f:
            if not line.strip():
                continue
            d = json.loads(line)
            if d["input_length"] < 1 or d["output_length"] < 0:
                raise ValueError(f"trace: bad lengths in {line.strip()[:80]}")
            reqs.append(TraceRequest(d["timestamp"] / 1000.0, d["input_length"], max(1, d["output_length"]),
                                     hash_ids=list(d["hash_ids"])))
            if limit and len(reqs) >= limit:
                break
    return reqs


def load_lengths_json(path: str | Path, rate: float = 1.0, seed: int = 0) -> list[TraceRequest]:
    """A ShareGPT-like JSON list of ``{"input_length", "output_length"}`` (or conversations with
    ``input_len``/``output_len``); arrivals are Poisson at ``rate`` per second."""
    data = json.loads(Path(path).read_text())
    rng = random.Random(seed)
    t, reqs = 0.0, []
    for d in data:
        t += rng.expovariate(rate)
        reqs.append(TraceRequest(t, int(d.get("input_length", d.get("input_len"))),
                                 max(1, int(d.get("output_length", d.get("output_len"))))))
    return reqs


def synthetic(num_requests: int, rate: float, input_len: tuple[int, int], output_len: tuple[int, int],
              system_prompt_len: int = 0, num_system_prompts: int = 1, turns: int = 1,
              seed: int = 0) -> list[TraceRequest]:
    """Poisson arrivals; optional shared system prompts; ``turns > 1`` makes multi-turn sessions
    whose each turn's prompt extends the previous turn's prompt and answer."""
    rng = random.Random(seed)
    t, reqs, content = 0.0, [], 1 << 40
    sessions = max(1, num_requests // turns)
    for s in range(sessions):
        sys_id = rng.randrange(num_system_prompts) if system_prompt_len else None
        segments: list[tuple[int, int]] = [(sys_id + 1, system_prompt_len)] if sys_id is not None else []
        session_t = t = t + rng.expovariate(rate)
        for _ in range(turns):
            if len(reqs) >= num_requests:
                break
            content += 1
            segments = segments + [(content, rng.randint(*input_len))]
            out = rng.randint(*output_len)
            reqs.append(TraceRequest(session_t, sum(n for _, n in segments), out, segments=list(segments)))
            content += 1
            segments = segments + [(content, out)]  # the answer becomes part of the next prompt
            session_t += rng.expovariate(rate / 4)
    reqs.sort(key=lambda r: r.arrival_s)
    return reqs


def rag(num_requests: int, rate: float, num_docs: int, doc_len: int, docs_per_prompt: int,
        question_len: tuple[int, int], output_len: tuple[int, int], system_prompt_len: int = 0,
        seed: int = 0) -> list[TraceRequest]:
    """Retrieval-augmented prompts: a shared system prompt, ``docs_per_prompt`` of ``num_docs``
    documents (``doc_len`` tokens each) drawn at random in a random order, then a question of its
    own; Poisson arrivals. The same document sits at many positions, so prefix caching serves
    little of it and segment reuse most (each piece of ``segments`` is a segment)."""
    if not 1 <= docs_per_prompt <= num_docs:
        raise ValueError(f"docs_per_prompt must be in [1, num_docs={num_docs}], got {docs_per_prompt}")
    rng = random.Random(seed)
    t, reqs, question = 0.0, [], 1 << 41
    for _ in range(num_requests):
        t += rng.expovariate(rate)
        pieces = [(1, system_prompt_len)] if system_prompt_len else []
        pieces += [(2 + d, doc_len) for d in rng.sample(range(num_docs), docs_per_prompt)]
        question += 1
        pieces.append((question, rng.randint(*question_len)))
        reqs.append(TraceRequest(t, sum(n for _, n in pieces), rng.randint(*output_len), segments=pieces))
    return reqs


def images(num_requests: int, rate: float, num_images: int, image_tokens: int, prefix_len: tuple[int, int],
           question_len: tuple[int, int], output_len: tuple[int, int], seed: int = 0) -> list[TraceRequest]:
    """Image chats where many requests share a few images: a text of its own (``prefix_len``), one
    of ``num_images`` images (``image_tokens`` positions), a question of its own; Poisson
    arrivals. The text before the image differs, so an image's KV never hits: only an encoder
    cache saves its encoding."""
    rng = random.Random(seed)
    t, reqs, content = 0.0, [], 1 << 42
    for _ in range(num_requests):
        t += rng.expovariate(rate)
        head = rng.randint(*prefix_len)
        pieces = [(content, head), (IMAGE_TOKEN, image_tokens), (content + 1, rng.randint(*question_len))]
        content += 2
        reqs.append(TraceRequest(t, sum(n for _, n in pieces), rng.randint(*output_len), segments=pieces,
                                 images=[(head, image_tokens, rng.randrange(num_images))]))
    return reqs
