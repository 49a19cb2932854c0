"""Turns logits into tokens: greedy, temperature, top-k, top-p, min-p, seeded generators;
structured outputs' masks, allowed token ids, penalties, logit bias and bans (min_tokens' stop
tokens, bad words) adjust the logits first."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kvos.core.sampling_params import SamplingParams
from kvos.models.ops import use_kernels
from kvos.worker.host_copies import to_device

SAMPLING_KERNELS_ON_CPU = False
"""Let CPU tensors take the sampling Triton kernels too (tests, under Triton's interpreter);
otherwise they run on CUDA only, and the CPU keeps the same sets with torch ops (a sort for
top-p without top-k) and draws by an exponential race."""


class SeedStream:
    """A seeded request's kernel seeds, one per draw, computed on the host: splitmix64 of the
    request's key plus a draw counter. The sampling kernels take one seed per row and step, so a
    seeded row then costs no device launch of its own (a device generator costs two per row and
    step); its draws depend only on its key and how many it has drawn, whatever the batch."""

    __slots__ = ("key", "drawn")
    GOLDEN = 0x9E3779B97F4A7C15
    MASK = (1 << 64) - 1

    def __init__(self, key: int) -> None:
        self.key = key & self.MASK
        self.drawn = 0

    def next(self) -> int:
        """The next seed, in [0, 2^62)."""
        self.drawn += 1
        z = (self.key + self.drawn * self.GOLDEN) & self.MASK
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & self.MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & self.MASK
        return (z ^ (z >> 31)) >> 2


@dataclass
class SampleRow:
    """One sequence to sample from logits row ``row``. ``generator`` is set for seeded requests,
    and ``seed_stream`` (the kernels' per-step seeds) where the runner gives one.

    Set only for requests whose params adjust the logits (``SamplingParams.adjusts_logits``):
    ``output_ids``, the generated tokens known to the host, and ``pending_src``, the row of the
    previous launch's device tokens holding one more generated token (-1: none), for penalties
    and ``ban_after``; ``prompt_ids`` for the repetition penalty; ``ban_ids``, tokens that cannot
    be sampled (EOS and stop tokens before ``min_tokens``, bad words); ``ban_after``, (token,
    previous) pairs: ``token`` cannot be sampled if the pending token is ``previous``.
    """

    row: int
    params: SamplingParams
    generator: torch.Generator | None = None
    output_ids: list[int] | None = None
    prompt_ids: list[int] | None = None
    pending_src: int = -1
    ban_ids: list[int] | None = None
    seed_stream: SeedStream | None = None
    ban_after: list[tuple[int, int]] | None = None


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None
    rank: int | None = None
    """With ``logprob``: 1 + the number of tokens more likely than this one (whole vocabulary)."""
    top_logprobs: list[tuple[int, float]] | None = None
    spec_token_ids: list[int] | None = None
    """A verify step's tokens: the accepted drafts, then ``token_id``."""


@dataclass
class PendingSamples:
    """Tokens sampled on the device, on their way to the host.

    ``tokens`` (device, int64 ``[rows]``) can feed the next step's inputs before the host sees
    them. The host copies are valid only after ``ready`` (a CUDA event; None on the CPU) has
    completed: ``Sampler.collect`` waits for it.
    """

    rows: list[SampleRow]
    tokens: torch.Tensor
    host_tokens: torch.Tensor
    host_logprob: torch.Tensor | None = None
    host_rank: torch.Tensor | None = None
    host_top_ids: torch.Tensor | None = None
    host_top_vals: torch.Tensor | None = None
    ready: torch.cuda.Event | None = None


@dataclass
class PromptLogprobRows:
    """Rows of one request's prefill chunk that score its prompt tokens ``first, first + 1,
    ...`` (``token_ids``, each given the tokens before it), with the top ``k`` tokens' too."""

    request_id: str
    first: int
    token_ids: list[int]
    k: int


@dataclass
class PendingPromptLogprobs:
    """A step's prompt logprobs on their way to the host: ``host`` is float32 ``[rows, 2 + 2K]``
    (each prompt token's logprob and rank, the top-K logprobs, then their token ids; ids and
    ranks exact in float32 below 2**24), valid once ``ready`` (a CUDA event; None on the CPU)
    has completed."""

    entries: list[PromptLogprobRows]
    host: torch.Tensor
    top: int
    ready: torch.cuda.Event | None = None

    def collect(self) -> dict[str, tuple[int, list[dict[int, tuple[float, int]]]]]:
        """Wait for the copy; per request id, (its first prompt position, one dict per row of
        token -> (logprob, rank): the prompt token first, then the top-k ranked 1 .. k, as vLLM
        orders them)."""
        if self.ready is not None:
            self.ready.synchronize()
        rows, K, out, r = self.host.tolist(), self.top, {}, 0
        for e in self.entries:
            dicts = []
            for tok, row in zip(e.token_ids, rows[r: r + len(e.token_ids)]):
                d = {tok: (row[0], int(row[1]))}
                for rank, (i, v) in enumerate(zip(row[2 + K: 2 + K + e.k], row[2: 2 + e.k]), 1):
                    d.setdefault(int(i), (v, rank))
                dicts.append(d)
            out[e.request_id] = (e.first, dicts)
            r += len(e.token_ids)
        return out


def prompt_logprobs(compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                    targets: torch.Tensor, top: int, vocab_size: int,
                    max_elements: int = 1 << 25) -> torch.Tensor:
    """Float32 ``[rows, 2 + 2 * top]``: per hidden row, ``log_softmax`` (float32) of its logits
    at its target token and the target's rank (1 + tokens more likely), then the ``top`` largest
    logprobs and their token ids. One gather per
    ``max_elements`` logits (128 MiB: a 262k vocabulary makes 128 rows at a time, SmolLM2's 682),
    so a long prefill chunk never holds all its logits at once."""
    n = hidden.shape[0]
    out = torch.empty(n, 2 + 2 * top, dtype=torch.float32, device=hidden.device)
    step = max(1, max_elements // vocab_size)
    for a in range(0, n, step):
        b = min(n, a + step)
        logprobs = torch.log_softmax(compute_logits(hidden[a:b]).float(), dim=-1)
        out[a:b, 0] = logprobs.gather(1, targets[a:b, None])[:, 0]
        out[a:b, 1] = rank_of(logprobs, out[a:b, 0]).float()
        if top:
            vals, ids = logprobs.topk(top, dim=-1)
            out[a:b, 2: 2 + top] = vals
            out[a:b, 2 + top:] = ids.float()
    return out


def rank_of(logprobs: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """Per row, 1 + the number of tokens whose logprob is above ``chosen``'s (vLLM's rank)."""
    return (logprobs > chosen[:, None]).sum(dim=-1) + 1


def _adjusts(r: SampleRow) -> bool:
    sp = r.params
    return bool(r.ban_ids or r.ban_after or sp.logit_bias or sp.needs_history or sp.allowed_token_ids)


AllowedMasks = tuple[list[int], np.ndarray]
"""Structured outputs' masks for some rows of a batch: (row indices, int32 ``[rows, words]``);
bit ``t % 32`` of word ``t // 32`` is set when token ``t`` may be sampled (tokens past the words
may not)."""


def apply_allowed_masks(logits: torch.Tensor, allowed: AllowedMasks) -> torch.Tensor:
    """A new tensor: ``logits`` with every token a masked row does not allow at -inf. One
    host-to-device copy (row indices and words together); the bits unpack on the device."""
    rows, words = allowed
    dev, V = logits.device, logits.shape[1]
    M, W = words.shape
    packed = np.empty(M + M * W, np.int32)
    packed[:M] = rows
    packed[M:] = words.reshape(-1)
    t = to_device(packed, torch.int32, dev)
    idx, w = t[:M].long(), t[M:].view(M, W)
    bits = (w[:, :, None] >> torch.arange(32, dtype=torch.int32, device=dev)) & 1  # [M, W, 32]
    keep = bits.view(M, W * 32)
    keep = keep[:, :V] if W * 32 >= V else torch.cat([keep, keep.new_zeros(M, V - W * 32)], dim=1)
    return logits.index_copy(0, idx, logits.index_select(0, idx).masked_fill(keep == 0, float("-inf")))


def adjust_logits(logits: torch.Tensor, rows: list[SampleRow],
                  prev_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """A new float32 tensor: ``logits`` (one row per entry of ``rows``) with every token outside
    a row's ``allowed_token_ids`` at -inf, its logit bias added, its banned tokens at -inf (and
    those of ``ban_after`` whose previous token is the pending one), then its repetition,
    frequency and presence penalties applied (vLLM's order). Batched: one host-to-device copy of
    the index lists, one scatter per kind, a few elementwise ops over the rows that ask for them."""
    dev = logits.device
    sel = [i for i, r in enumerate(rows) if _adjusts(r)]
    x = logits[to_device(sel, torch.long, dev)] if len(sel) < len(rows) else logits.clone()
    R, V = x.shape
    pen_rows, bias_rows, bias_ids, bias_vals, ban_rows, ban_ids = [], [], [], [], [], []
    allow_sel, allow_rows, allow_ids, after_rows, after_ids, after_prev, after_src = [], [], [], [], [], [], []
    out_rows, out_ids, prm_rows, prm_ids, pend_rows, pend_src = [], [], [], [], [], []
    freq, pres, rep = [], [], []
    for j, i in enumerate(sel):
        r, sp = rows[i], rows[i].params
        if sp.allowed_token_ids:
            allow_rows.extend([len(allow_sel)] * len(sp.allowed_token_ids))
            allow_sel.append(j)
            allow_ids.extend(sp.allowed_token_ids)
        if r.ban_after:
            assert r.pending_src >= 0, "a ban on the pending token needs its row"
            after_rows.extend([j] * len(r.ban_after))
            after_ids.extend(t for t, _ in r.ban_after)
            after_prev.extend(p for _, p in r.ban_after)
            after_src.extend([r.pending_src] * len(r.ban_after))
        if sp.logit_bias:
            bias_rows.extend([j] * len(sp.logit_bias))
            bias_ids.extend(sp.logit_bias)
            bias_vals.extend(sp.logit_bias.values())
        if r.ban_ids:
            ban = [t for t in r.ban_ids if t < V]  # a stop token id past the vocabulary is never sampled
            ban_rows.extend([j] * len(ban))
            ban_ids.extend(ban)
        if sp.needs_history:
            k = len(pen_rows)
            pen_rows.append(j)
            freq.append(float(sp.frequency_penalty))
            pres.append(float(sp.presence_penalty))
            rep.append(float(sp.repetition_penalty))
            outs = r.output_ids or []
            out_rows.extend([k] * len(outs))
            out_ids.extend(outs)
            if r.pending_src >= 0:
                pend_rows.append(k)
                pend_src.append(r.pending_src)
            if sp.repetition_penalty != 1.0 and r.prompt_ids:
                prm_rows.extend([k] * len(r.prompt_ids))
                prm_ids.extend(r.prompt_ids)
    lists = [bias_rows, bias_ids, ban_rows, ban_ids, pen_rows, out_rows, out_ids, prm_rows, prm_ids,
             pend_rows, pend_src, allow_sel, allow_rows, allow_ids, after_rows, after_ids, after_prev, after_src]
    packed = to_device(np.concatenate([np.asarray(v, np.int64) for v in lists]), torch.long, dev)
    parts, o = [], 0
    for v in lists:
        parts.append(packed[o: o + len(v)])
        o += len(v)
    (t_bias_rows, t_bias_ids, t_ban_rows, t_ban_ids, t_pen_rows, t_out_rows, t_out_ids, t_prm_rows,
     t_prm_ids, t_pend_rows, t_pend_src, t_allow_sel, t_allow_rows, t_allow_ids, t_after_rows, t_after_ids,
     t_after_prev, t_after_src) = parts
    if allow_sel:
        keep = torch.zeros(len(allow_sel), V, dtype=torch.bool, device=dev)
        keep.index_put_((t_allow_rows, t_allow_ids), torch.ones((), dtype=torch.bool, device=dev))
        x.index_copy_(0, t_allow_sel, x.index_select(0, t_allow_sel).masked_fill(~keep, float("-inf")))
    if bias_rows:
        x.index_put_((t_bias_rows, t_bias_ids), to_device(bias_vals, torch.float32, dev), accumulate=True)
    if ban_rows:
        x.index_put_((t_ban_rows, t_ban_ids), torch.full((len(ban_rows),), float("-inf"), device=dev))
    if after_rows:
        assert prev_tokens is not None, "a ban on the pending token needs the previous launch's tokens"
        hit = prev_tokens.index_select(0, t_after_src) == t_after_prev
        # added, not assigned: two pairs may ban one token, and only a hit adds -inf (0 otherwise)
        ninf = torch.zeros(len(after_rows), device=dev).masked_fill_(hit, float("-inf"))
        x.index_put_((t_after_rows, t_after_ids), ninf, accumulate=True)
    if pen_rows:
        P = len(pen_rows)
        counts = torch.zeros(P, V, dtype=torch.float32, device=dev)
        if out_rows:
            counts.index_put_((t_out_rows, t_out_ids), torch.ones((), device=dev).expand(len(out_rows)),
                              accumulate=True)
        if pend_rows:
            assert prev_tokens is not None, "a pending token needs the previous launch's tokens"
            counts.index_put_((t_pend_rows, prev_tokens.index_select(0, t_pend_src)),
                              torch.ones((), device=dev).expand(len(pend_rows)), accumulate=True)
        y = x.index_select(0, t_pen_rows)
        if any(p != 1.0 for p in rep):
            seen = counts > 0
            if prm_rows:
                seen = seen.index_put((t_prm_rows, t_prm_ids), torch.ones((), dtype=torch.bool, device=dev))
            p = to_device(rep, torch.float32, dev)[:, None]
            y = torch.where(seen, torch.where(y > 0, y / p, y * p), y)
        if any(freq) or any(pres):
            f = to_device(freq, torch.float32, dev)[:, None]
            pr = to_device(pres, torch.float32, dev)[:, None]
            y = y - f * counts - pr * (counts > 0).float()
        x.index_copy_(0, t_pen_rows, y)
    if len(sel) < len(rows):
        return logits.index_copy(0, to_device(sel, torch.long, dev), x)
    return x


def sorted_top_p_threshold(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per row of ``probs`` (float32 ``[R, V]``), the top-p threshold tau through a sort (the CPU's
    path; ``kvos.kernels.top_p`` keeps the same set on a GPU): the kept set ``probs >= tau`` is every token whose
    strictly more probable tokens weigh less than ``top_p`` (float32 sums; ties kept together;
    the most probable token always). 0.0 where ``top_p >= 1``."""
    vals = probs.sort(dim=-1, descending=True).values
    # the mass of the better ranks (at the first of tied values: the mass strictly above), which
    # never decreases along the row, so the kept ranks are a prefix
    before = torch.cat([torch.zeros_like(vals[:, :1]), vals[:, :-1].cumsum(dim=-1)], dim=-1)
    kept = (before < top_p[:, None]).sum(dim=-1).clamp(min=1)
    tau = vals.gather(1, (kept - 1)[:, None])[:, 0]
    return torch.where(top_p >= 1, torch.zeros_like(tau), tau)


class Sampler:
    """Samples each row independently; a seeded row's draws depend only on its own generator,
    so its output does not change with batch composition. ``launch`` only queues device work
    (no host synchronisation); ``collect`` waits for the results."""

    def __call__(self, logits: torch.Tensor, rows: list[SampleRow],
                 prev_tokens: torch.Tensor | None = None) -> list[SampledToken]:
        return self.collect(self.launch(logits, rows, prev_tokens))

    def launch(self, logits: torch.Tensor, rows: list[SampleRow],
               prev_tokens: torch.Tensor | None = None, allowed: AllowedMasks | None = None) -> PendingSamples:
        """``prev_tokens``: the previous launch's device tokens, read by rows with a
        ``pending_src``. ``allowed``: structured outputs' masks, by index into ``rows``
        (applied first: a masked token stays impossible whatever the bias and penalties do)."""
        dev = logits.device
        if [r.row for r in rows] != list(range(logits.shape[0])):
            logits = logits[to_device([r.row for r in rows], torch.long, dev)]
        if allowed is not None and allowed[0]:
            logits = apply_allowed_masks(logits, allowed)
        if any(_adjusts(r) for r in rows):
            logits = adjust_logits(logits.float(), rows, prev_tokens)
        greedy = [r.params.greedy for r in rows]  # argmax is the same in the logits' own dtype
        if not any(greedy):
            tokens = self._sample(logits, rows)
        else:
            tokens = logits.argmax(dim=-1)
            if not all(greedy):
                tokens = torch.where(to_device(greedy, torch.bool, dev), tokens, self._sample(logits, rows))
        out = PendingSamples(rows, tokens, self._to_host(tokens))
        want = [r.params.logprobs for r in rows if r.params.logprobs is not None]
        if want:
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            chosen = logprobs.gather(1, tokens[:, None])[:, 0]
            out.host_logprob, out.host_rank = self._to_host(chosen), self._to_host(rank_of(logprobs, chosen))
            k = max(want)
            if k > 0:
                vals, ids = logprobs.topk(k, dim=-1)
                out.host_top_ids, out.host_top_vals = self._to_host(ids), self._to_host(vals)
        if dev.type == "cuda":
            out.ready = torch.cuda.Event()
            out.ready.record()
        return out

    @staticmethod
    def _to_host(t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "cuda":
            return t
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        return host.copy_(t, non_blocking=True)

    @staticmethod
    def collect(p: PendingSamples) -> list[SampledToken]:
        if p.ready is not None:
            p.ready.synchronize()
        token_list = p.host_tokens.tolist()
        lps = p.host_logprob.tolist() if p.host_logprob is not None else None
        ranks = p.host_rank.tolist() if p.host_rank is not None else None
        top_ids = p.host_top_ids.tolist() if p.host_top_ids is not None else None
        top_vals = p.host_top_vals.tolist() if p.host_top_vals is not None else None
        out = []
        for i, (r, tok) in enumerate(zip(p.rows, token_list)):
            st = SampledToken(tok)
            k = r.params.logprobs
            if k is not None and lps is not None:
                st.logprob = lps[i]
                st.rank = ranks[i] if ranks is not None else None
                if k > 0 and top_ids is not None and top_vals is not None:
                    st.top_logprobs = list(zip(top_ids[i][:k], top_vals[i][:k]))
            out.append(st)
        return out

    CANDIDATES = 1024
    """When every top-k row's ``top_k`` is at most this, candidates come from one ``topk`` over
    the vocabulary instead of a full sort."""

    @classmethod
    def _sample(cls, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """Temperature, top-k, top-p (over the top-k survivors) and min-p, then a draw from what
        is kept (the exponential race ``argmax(probs / Exp(1))``, or the kernel's rejection
        sampling on a GPU). Rows with a ``top_k``
        (greedy rows: 1) filter ranked candidates (``_sample_ranked``); the others filter the
        whole vocabulary in token order (``_sample_full``: no sort on a GPU). A mixed batch runs
        each path on its own rows.

        A seeded row's draws depend only on its own generator and parameters, whatever the batch:
        on the CPU, with ``top_k`` it draws ``top_k`` values in rank order, without it one value
        per token in token order; with the kernels (a GPU), one seed per step."""
        dev = logits.device
        R, V = logits.shape
        temps = [r.params.temperature if r.params.temperature > 0 else 1.0 for r in rows]
        # a greedy row takes its argmax anyway (one candidate), whatever its filters
        top_k = [1 if r.params.greedy else r.params.top_k if 0 < r.params.top_k < V else 0 for r in rows]
        ranked = [i for i, k in enumerate(top_k) if k]
        if not ranked:
            return cls._sample_full(logits, rows, temps)
        if len(ranked) == R:
            return cls._sample_ranked(logits, temps, rows, top_k)
        full = [i for i, k in enumerate(top_k) if not k]
        idx = to_device(ranked + full, torch.long, dev)
        idx_r, idx_f = idx[: len(ranked)], idx[len(ranked):]
        out = torch.empty(R, dtype=torch.long, device=dev)
        out.index_copy_(0, idx_r, cls._sample_ranked(logits.index_select(0, idx_r), [temps[i] for i in ranked],
                                                     [rows[i] for i in ranked], [top_k[i] for i in ranked]))
        out.index_copy_(0, idx_f, cls._sample_full(logits.index_select(0, idx_f), [rows[i] for i in full],
                                                   [temps[i] for i in full]))
        return out

    @staticmethod
    def _scaled(logits: torch.Tensor, temps: list[float]) -> torch.Tensor:
        """float32 logits over their rows' temperatures."""
        return logits.float() / to_device(temps, torch.float32, logits.device)[:, None]

    @classmethod
    def _sample_ranked(cls, logits: torch.Tensor, temps: list[float], rows: list[SampleRow],
                       top_k: list[int]) -> torch.Tensor:
        """Rows that all have a ``top_k``. Candidates in rank order, ranked on the logits as they
        are (a positive temperature does not change the order), then only they are scaled: one
        ``topk`` when every ``top_k`` is at most ``CANDIDATES``, else a full sort; then top-k,
        top-p over the top-k survivors and min-p on them."""
        dev = logits.device
        top_p = [1.0 if r.params.greedy else r.params.top_p for r in rows]
        if all(k <= cls.CANDIDATES for k in top_k):
            vals, order = logits.topk(max(top_k), dim=-1)  # sorted, descending
            if use_kernels(logits) or SAMPLING_KERNELS_ON_CPU:
                from kvos.kernels.top_p import ranked_sample
                params = to_device([temps, top_k, top_p, [r.params.min_p for r in rows]], torch.float32, dev)
                return ranked_sample(vals, order, params, cls._seeds(rows, dev))
        else:
            vals, order = logits.sort(dim=-1, descending=True)
        vals = cls._scaled(vals, temps)
        K = vals.shape[1]
        ranks = torch.arange(K, device=dev)[None, :]
        vals = vals.masked_fill(ranks >= to_device(top_k, torch.long, dev)[:, None], float("-inf"))
        if any(p < 1 for p in top_p):
            probs = vals.softmax(dim=-1)
            before = probs.cumsum(dim=-1) - probs  # mass of strictly better candidates
            p = to_device(top_p, torch.float32, dev)
            vals = vals.masked_fill((before >= p[:, None]) & (ranks > 0), float("-inf"))
        probs = cls._min_p(vals.softmax(dim=-1), [r.params.min_p for r in rows], ranked=True)
        choice = (probs / cls._noise(rows, top_k, K, dev)).argmax(dim=-1)
        return order.gather(1, choice[:, None])[:, 0]

    @classmethod
    def _sample_full(cls, logits: torch.Tensor, rows: list[SampleRow], temps: list[float]) -> torch.Tensor:
        """Rows without a ``top_k``, over the whole vocabulary in token order. On a GPU, one
        kernel (``kvos.kernels.top_p.nucleus_sample``): rejection sampling of top-p and min-p's
        kept set straight from the logits, one seed per row. Elsewhere: the softmax, top-p's
        threshold through a sort, min-p, then the race. Neither needs a renormalisation."""
        dev = logits.device
        top_p = [r.params.top_p for r in rows]
        min_p = [r.params.min_p for r in rows]
        if use_kernels(logits) or SAMPLING_KERNELS_ON_CPU:
            from kvos.kernels.top_p import nucleus_sample
            t, p, mp = to_device([temps, top_p, min_p], torch.float32, dev)
            return nucleus_sample(logits, t, p, mp, cls._seeds(rows, dev))
        probs = cls._scaled(logits, temps).softmax(dim=-1)
        if any(p < 1 for p in top_p):
            tau = sorted_top_p_threshold(probs, to_device(top_p, torch.float32, dev))
            probs = probs.masked_fill(probs < tau[:, None], 0.0)
        probs = cls._min_p(probs, min_p, ranked=False)
        return (probs / cls._noise(rows, [0] * len(rows), logits.shape[1], dev)).argmax(dim=-1)

    @staticmethod
    def _seeds(rows: list[SampleRow], device: torch.device) -> torch.Tensor:
        """One int64 seed per row for the kernel: unseeded rows' from one draw of the device's
        default generator; a seeded row's from its ``seed_stream`` (all of them in one host copy),
        or, without one, from its own generator (one per step)."""
        seeds = torch.randint(0, 1 << 62, (len(rows),), device=device)
        streamed = [i for i, r in enumerate(rows) if r.seed_stream is not None]
        if streamed:
            values = to_device([[i, rows[i].seed_stream.next()] for i in streamed], torch.int64, device)
            seeds.index_copy_(0, values[:, 0], values[:, 1])
        for i, r in enumerate(rows):
            if r.generator is not None and r.seed_stream is None:
                seeds[i: i + 1] = torch.randint(0, 1 << 62, (1,), device=device, generator=r.generator)
        return seeds

    @staticmethod
    def _min_p(probs: torch.Tensor, min_p: list[float], ranked: bool) -> torch.Tensor:
        """Zero the tokens below ``min_p`` times the row's top probability (column 0 when the
        columns are in rank order)."""
        if not any(m > 0 for m in min_p):
            return probs
        top = probs[:, :1] if ranked else probs.max(dim=-1, keepdim=True).values
        mp = to_device(min_p, torch.float32, probs.device)
        return probs.masked_fill(probs < mp[:, None] * top, 0.0)

    @staticmethod
    def _noise(rows: list[SampleRow], top_k: list[int], width: int, device: torch.device) -> torch.Tensor:
        """Exp(1) noise, ``width`` columns: the candidates in rank order for rows with a
        ``top_k``, every token in token order for the others. One launch serves the unseeded
        rows; a seeded row draws its own: ``top_k`` values, or one per token."""
        noise = torch.empty(len(rows), width, device=device).exponential_()
        for i, r in enumerate(rows):
            if r.generator is None:
                continue
            if top_k[i]:
                noise[i, :top_k[i]].exponential_(generator=r.generator)
            else:
                noise[i] = torch.empty(width, device=device).exponential_(generator=r.generator)
        return noise
