"""Turns logits into tokens: greedy, temperature, top-k, top-p, min-p, seeded generators."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvos.engine.sampling_params import SamplingParams


@dataclass
class SampleRow:
    """One sequence to sample from logits row ``row``. ``generator`` is set for seeded requests."""

    row: int
    params: SamplingParams
    generator: torch.Generator | None = None


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


class Sampler:
    """Samples each row independently; a seeded row's draws depend only on its own generator,
    so its output does not change with batch composition."""

    def __call__(self, logits: torch.Tensor, rows: list[SampleRow]) -> list[SampledToken]:
        if not rows:
            return []
        idx = torch.tensor([r.row for r in rows], device=logits.device)
        logits = logits.float()[idx]
        greedy = [r.params.greedy for r in rows]
        want_lp = any(r.params.logprobs is not None for r in rows)
        logprobs = torch.log_softmax(logits, dim=-1) if want_lp else None

        tokens = logits.argmax(dim=-1)
        if not all(greedy):
            sampled = self._sample(logits, rows)
            tokens = torch.where(torch.tensor(greedy, device=logits.device), tokens, sampled)
        token_list = tokens.tolist()
        out = []
        for i, (r, tok) in enumerate(zip(rows, token_list)):
            st = SampledToken(tok)
            if r.params.logprobs is not None and logprobs is not None:
                st.logprob = float(logprobs[i, tok])
                if r.params.logprobs > 0:
                    vals, ids = logprobs[i].topk(r.params.logprobs)
                    st.top_logprobs = list(zip(ids.tolist(), vals.tolist()))
            out.append(st)
        return out

    @staticmethod
    def _sample(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        dev = logits.device
        temp = torch.tensor([r.params.temperature if r.params.temperature > 0 else 1.0 for r in rows],
                            device=dev)
        x = logits / temp[:, None]
        top_k = [r.params.top_k for r in rows]
        top_p = [r.params.top_p for r in rows]
        min_p = [r.params.min_p for r in rows]
        if any(k > 0 for k in top_k) or any(p < 1 for p in top_p):
            x_sorted, order = x.sort(dim=-1, descending=True)
            vocab = x.shape[-1]
            k = torch.tensor([k if k > 0 else vocab for k in top_k], device=dev)
            ranks = torch.arange(vocab, device=dev)[None, :]
            x_sorted = x_sorted.masked_fill(ranks >= k[:, None], float("-inf"))
            p = torch.tensor(top_p, device=dev)
            probs = x_sorted.softmax(dim=-1)
            before = probs.cumsum(dim=-1) - probs  # mass of strictly better tokens
            x_sorted = x_sorted.masked_fill((before >= p[:, None]) & (ranks > 0), float("-inf"))
            x = torch.full_like(x, float("-inf")).scatter(-1, order, x_sorted)
        probs = x.softmax(dim=-1)
        if any(m > 0 for m in min_p):
            mp = torch.tensor(min_p, device=dev)
            probs = probs.masked_fill(probs < mp[:, None] * probs.max(dim=-1, keepdim=True).values, 0.0)
        noise = torch.empty_like(probs)
        for i, r in enumerate(rows):
            noise[i].exponential_(generator=r.generator)
        return (probs / noise).argmax(dim=-1)
