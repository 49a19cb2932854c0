"""Verification of speculative drafts: greedy matching, and rejection sampling that keeps the
target's distribution (Leviathan et al. 2023; Chen et al. 2023).

For a sequence with drafts ``d_1..d_k`` the target's logits at the ``k + 1`` positions from its
last known token give the filtered distributions ``p_0..p_k`` (temperature, top-k, top-p, min-p:
the sampler's kept sets, ``filtered_probs``). Draft ``d_i`` is accepted with probability
``min(1, p_{i-1}(d_i) / q_{i-1}(d_i))`` while every draft before it was; at the first rejection
the token is drawn from the residual ``max(0, p - q)`` renormalised, and when all ``k`` hold, a
bonus token from ``p_k``. The output is then distributed as ``p`` whatever ``q`` proposed. A
proposer without probabilities (n-gram lookup) is a point mass: ``q = onehot(d)``, so ``d`` is
accepted with probability ``p(d)`` and the residual is ``p`` without ``d``. Greedy rows accept
while ``d_i`` is the argmax and end with the argmax: exactly the tokens plain decoding gives.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvos.core.sampling_params import SamplingParams
from kvos.worker.host_copies import to_device
from kvos.worker.sampler import Sampler, sorted_top_p_threshold


@dataclass
class DraftRows:
    """One sequence's verification: logits rows ``first .. first + len(draft_ids)`` score the
    positions from its last known token on. ``draft_probs``: the proposer's distributions at the
    drafts' positions (float32 ``[k, V]``; None: point masses on the drafts)."""

    request_id: str
    first: int
    draft_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None = None
    draft_probs: torch.Tensor | None = None


@dataclass
class PendingVerify:
    """Verifications on their way to the host: per row, whether its draft held and the token
    the row yields if it is the first one that did not (residual or bonus sample). Valid once
    ``ready`` (a CUDA event; None on the CPU) has completed."""

    entries: list[DraftRows]
    accept: torch.Tensor
    tokens: torch.Tensor
    ready: torch.cuda.Event | None = None

    def collect(self) -> dict[str, list[int]]:
        """Per request id, the accepted drafts then the target's token."""
        if self.ready is not None:
            self.ready.synchronize()
        accept, tokens, out, r = self.accept.tolist(), self.tokens.tolist(), {}, 0
        for e in self.entries:
            k = len(e.draft_ids)
            a = 0
            while a < k and accept[r + a]:
                a += 1
            out[e.request_id] = e.draft_ids[:a] + [int(tokens[r + a])]
            r += k + 1
        return out


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """float32 ``[R, V]``: each row's sampling distribution after temperature, top-k, top-p (over
    the top-k survivors) and min-p, renormalised (the sets ``Sampler`` draws from; ties at a
    cut are kept together). Greedy rows are a point mass on the argmax."""
    dev = logits.device
    R, V = logits.shape
    temps = [p.temperature if p.temperature > 0 else 1.0 for p in params]
    probs = (logits.float() / to_device(temps, torch.float32, dev)[:, None]).softmax(dim=-1)
    top_k = [p.top_k if 0 < p.top_k < V else V for p in params]
    if any(k < V for k in top_k):
        kth = probs.topk(max(top_k), dim=-1).values.gather(1, to_device(top_k, torch.long, dev)[:, None] - 1)
        probs = probs.masked_fill(probs < kth, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    top_p = [p.top_p for p in params]
    if any(p < 1 for p in top_p):
        tau = sorted_top_p_threshold(probs, to_device(top_p, torch.float32, dev))
        probs = probs.masked_fill(probs < tau[:, None], 0.0)
    min_p = [p.min_p for p in params]
    if any(m > 0 for m in min_p):
        top = probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < to_device(min_p, torch.float32, dev)[:, None] * top, 0.0)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if greedy:
        idx = to_device(greedy, torch.long, dev)
        onehot = torch.zeros(len(greedy), V, device=dev)
        onehot.scatter_(1, logits.index_select(0, idx).argmax(dim=-1, keepdim=True), 1.0)
        probs = probs.index_copy(0, idx, onehot)
    return probs


def launch_verify(logits: torch.Tensor, entries: list[DraftRows]) -> PendingVerify:
    """Queue every entry's verification on ``logits``' device; no host synchronisation. A
    seeded entry draws its uniforms and residual noise from its own generator, so its tokens do
    not depend on the batch."""
    dev = logits.device
    rows: list[int] = []
    drafts: list[int] = []  # per row: its draft, -1 on a sequence's last (bonus) row
    row_params: list[SamplingParams] = []
    for e in entries:
        k = len(e.draft_ids)
        rows.extend(range(e.first, e.first + k + 1))
        drafts.extend([*e.draft_ids, -1])
        row_params.extend([e.params] * (k + 1))
    R, V = len(rows), logits.shape[1]
    x = logits.index_select(0, to_device(rows, torch.long, dev))
    if all(p.greedy for p in row_params):
        target = x.argmax(dim=-1)
        accept = target == to_device(drafts, torch.long, dev)
        out = PendingVerify(entries, Sampler._to_host(accept), Sampler._to_host(target))
    else:
        p = filtered_probs(x, row_params)
        d = to_device(drafts, torch.long, dev)
        has = d >= 0
        dc = d.clamp(min=0)[:, None]
        q = torch.zeros_like(p)
        q.scatter_(1, dc, has[:, None].float())  # point masses unless a proposer gave probabilities
        r = 0
        for e in entries:
            if e.draft_probs is not None:
                q[r: r + len(e.draft_ids)] = e.draft_probs.to(dev, torch.float32)
            r += len(e.draft_ids) + 1
        pd, qd = p.gather(1, dc)[:, 0], q.gather(1, dc)[:, 0]
        uniform = torch.rand(R, device=dev)
        noise = torch.empty(R, V, device=dev).exponential_()
        r = 0
        for e in entries:  # seeded sequences draw their own
            n = len(e.draft_ids) + 1
            if e.generator is not None:
                uniform[r: r + n] = torch.rand(n, device=dev, generator=e.generator)
                noise[r: r + n] = torch.empty(n, V, device=dev).exponential_(generator=e.generator)
            r += n
        accept = has & (uniform * qd < pd)  # u < p/q, without dividing by a zero q
        residual = torch.where(has[:, None], (p - q).clamp(min=0), p)
        empty = residual.sum(dim=-1, keepdim=True) <= 0  # p <= q everywhere: p == q, never rejected
        residual = torch.where(empty, p, residual)
        tokens = (residual / noise).argmax(dim=-1)
        out = PendingVerify(entries, Sampler._to_host(accept), Sampler._to_host(tokens))
    if dev.type == "cuda":
        out.ready = torch.cuda.Event()
        out.ready.record()
    return out

