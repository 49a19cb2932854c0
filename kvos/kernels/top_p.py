"""Top-p (nucleus) sampling without a sort: an exact per-row threshold, then a one-pass race.

A row's top-p kept set is every token whose strictly more probable tokens weigh less than p
(the most probable token is always kept; tied tokens are kept or dropped together). With
``S(v)`` = the sum of the row's probabilities strictly greater than v, S is non-increasing and
only steps down at the row's probabilities, so the kept set is exactly ``probs >= tau`` where
``tau`` = the smallest float ``v >= 0`` with ``S(v) < p``: one of the row's probabilities (or 0
when even ``S(0) < p``: everything is kept). The rule holds for any positive scaling of the
row, so the sampler searches ``u = exp(x / T - m)`` (``m`` the row's maximum of ``x / T``: u is
the probability times the softmax's normaliser, 1 at the maximum) against p times the sum of
u, straight from the logits: no softmax tensor.

The threshold kernel finds tau by searching the int32 bit patterns of the non-negative floats,
which are ordered like the floats themselves, between a lower bound and 1.0 (``S(1) = 0``).
Each pass evaluates S at ``CANDIDATES`` bit patterns spread over the interval at once and keeps
the sub-interval where ``S < target`` starts, so a pass shrinks the interval
``CANDIDATES``-fold. After ``FULL_PASSES`` passes over the row, the values still inside the
interval (at most ``CAP``) are copied aside and the search ends on them in registers; S there is
the mass above the interval plus theirs. Within each phase S is summed in float32 in one fixed
order for every candidate, and a float sum of non-negative terms can only shrink when terms
are zeroed, so the computed S is non-increasing and the search is consistent; tau differs from
the float64 rule only for tokens whose mass above lies within float32 summation error of p.
(``p <= 0``, which ``SamplingParams`` refuses, would keep the maximum alone.)

The race kernel then draws one token per row from the kept set (and min-p's) in one pass: the
exponential race ``argmax(u / E)`` with ``E ~ Exp(1)`` drawn in the kernel from Philox, keyed
by the row's seed and the token id.

No host synchronisation; row lengths and strides are ``do_not_specialize``, so one compiled
variant serves every batch. Import only where triton is installed.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvos.kernels.tile_attention import _interpreter_index_fix

# Tokens one block of the row holds, and thresholds evaluated per pass: each block step builds a
# [CANDIDATES, BLOCK] comparison, accumulated elementwise and reduced once per pass. The work per
# token is CANDIDATES compare-select-adds a pass; one program per row, so wide blocks keep more
# loads in flight. On an H100, the threshold of 256 rows of 128,256 bf16 logits
# (benchmarks/scripts/top_p_kernels.py, 2026-11-27): 8 candidates, 4096-token blocks, 16 warps and
# 2 passes over the row before the registers take over: 0.50 ms (3 passes: 0.56 ms; 2048-token
# blocks: 0.55 ms; 4 or 16 candidates: slower); pipelining the row loops (num_stages) changed
# nothing.
_BLOCK = 4096
_NUM_WARPS = 16
CANDIDATES = 8
FULL_PASSES = 2
"""Search passes over the whole row before the values left in the interval are copied aside."""
CAP = 4096
"""Values of a row's interval that the rest of the search can hold in registers."""
RACE_BLOCK = 4096
RACE_WARPS = 16
"""The race kernel's tile: 0.15 ms for 256 rows of 128,256 bf16 logits on an H100 (2048 tokens
and 8 warps: 0.16 ms; 1024 tokens: 0.19-0.25 ms)."""

if triton.knobs.runtime.interpret:
    _interpreter_index_fix()  # the loops' bounds are runtime values


@triton.jit
def _unnormalized(x, inv_t, m):
    """``exp(x / T - m)``: a token's probability times the row's normaliser, in (0, 1] (1 at the
    row's maximum). Both sampling kernels compute it through this one expression, so the token
    the threshold search measures is the token the race keeps or drops."""
    return tl.exp(x.to(tl.float32) * inv_t - m)


@triton.jit
def _values(base, start, cols, V, inv_t, m, LOGITS: tl.constexpr):
    """A block of the searched values: probabilities as stored, or ``_unnormalized`` logits (0.0
    past the row's end either way)."""
    x = tl.load(base + start + cols, mask=start + cols < V, other=0.0)
    if LOGITS:
        x = tl.where(start + cols < V, _unnormalized(x, inv_t, m), 0.0)
    return x


@triton.jit
def _narrow(lo, hi, cand_bits, below):
    """The new [lo, hi] from one pass: tau is in (the last candidate with S >= target, the first
    with S < target]; ``below`` (S < target per candidate) is non-decreasing."""
    return tl.max(tl.where(below, lo, cand_bits + 1), axis=0), tl.min(tl.where(below, cand_bits, hi), axis=0)


@triton.jit
def _row_pass(base, V, inv_t, m, lo, hi, target, BLOCK: tl.constexpr, NC: tl.constexpr, LOGITS: tl.constexpr):
    """One search pass over the whole row: S at NC patterns spread over [lo, hi)."""
    cols = tl.arange(0, BLOCK)
    j = tl.arange(0, NC).to(tl.int64)
    # NC patterns in [lo, hi): lo + floor((hi - lo) * j / NC), int64 so the product cannot overflow
    cand_bits = lo + (hi - lo) * j // NC
    cand = cand_bits.to(tl.int32).to(tl.float32, bitcast=True)
    acc = tl.zeros([NC, BLOCK], tl.float32)
    for start in range(0, V, BLOCK):
        v = _values(base, start, cols, V, inv_t, m, LOGITS)
        acc += tl.where(v[None, :] > cand[:, None], v[None, :], 0.0)
    return _narrow(lo, hi, cand_bits, tl.sum(acc, axis=1) < target)


@triton.jit(do_not_specialize=["V", "stride"])
def _threshold_kernel(x_ptr, inv_t_ptr, top_p_ptr, cut_ptr, m_ptr, scratch_ptr, V, stride,
                      BLOCK: tl.constexpr, NC: tl.constexpr, LOGITS: tl.constexpr,
                      FULL_PASSES: tl.constexpr, CAP: tl.constexpr):
    """One program per row. The searched values are the row's probabilities, or with ``LOGITS``
    ``u = _unnormalized(x)`` after a pass for the row's maximum ``m`` of ``x / T`` (stored) and
    one for the sum of u (top-p's rule is invariant to scaling: S is compared with p times that
    sum), which also bounds tau from below: the tokens at or below ``v`` weigh at most ``V * v``,
    so S(v) >= target at ``v = (1 - p) * sum / (2 V)`` (used where p <= 0.999, so that the
    halving dwarfs float32 summation error).

    Invariant of the search over bit patterns [lo, hi]: S < target at hi, and S >= target at
    every pattern below lo, so tau's pattern lies in [lo, hi]; values are at most 1.0, where
    S = 0. After ``FULL_PASSES`` passes over the row, one more pass copies the values in
    [lo, hi) to the row's ``CAP`` slots of ``scratch`` and sums those at or above hi (A): for a
    candidate c in [lo, hi), S(c) = A + the sum of the copied values above c, so when they fit
    the rest of the search runs on them in registers. Otherwise it goes on over the row."""
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * stride
    p = tl.load(top_p_ptr + row)
    cols = tl.arange(0, BLOCK)
    inv_t = 1.0
    m = 0.0
    if LOGITS:
        inv_t = tl.load(inv_t_ptr + row)
        mx = tl.full([BLOCK], float("-inf"), tl.float32)
        for start in range(0, V, BLOCK):
            x = tl.load(base + start + cols, mask=start + cols < V, other=float("-inf"))
            mx = tl.maximum(mx, x.to(tl.float32) * inv_t)
        m = tl.max(mx, axis=0)
        tl.store(m_ptr + row, m)
    lo = tl.zeros([], tl.int64)
    if p < 1.0:  # p >= 1 keeps everything: no search, tau = 0.0
        target = p
        if LOGITS:
            total = tl.zeros([BLOCK], tl.float32)
            for start in range(0, V, BLOCK):
                total += _values(base, start, cols, V, inv_t, m, LOGITS)
            total_sum = tl.sum(total, axis=0)
            target = p * total_sum
            if p <= 0.999:  # tokens at or below (1 - p) * sum / V weigh at most (1 - p) * sum: S >= target
                lo = ((total_sum - target) * 0.5 / V).to(tl.int32, bitcast=True).to(tl.int64)
        hi = tl.full([], 1.0, tl.float32).to(tl.int32, bitcast=True).to(tl.int64)
        for _ in tl.static_range(FULL_PASSES):
            if lo < hi:
                lo, hi = _row_pass(base, V, inv_t, m, lo, hi, target, BLOCK, NC, LOGITS)
        if lo < hi:
            lo_f = lo.to(tl.int32).to(tl.float32, bitcast=True)
            hi_f = hi.to(tl.int32).to(tl.float32, bitcast=True)
            slots = scratch_ptr + row * CAP
            n = tl.zeros([], tl.int32)
            above = tl.zeros([BLOCK], tl.float32)
            for start in range(0, V, BLOCK):
                v = _values(base, start, cols, V, inv_t, m, LOGITS)
                sel = (v >= lo_f) & (v < hi_f) & (start + cols < V)
                pos = n + tl.cumsum(sel.to(tl.int32), axis=0) - 1
                tl.store(slots + pos, v, mask=sel & (pos < CAP))
                n += tl.sum(sel.to(tl.int32), axis=0)
                above += tl.where(v >= hi_f, v, 0.0)
            tl.debug_barrier()  # the slots written by every thread of the program, before reading
            if n <= CAP:
                a = tl.sum(above, axis=0)
                k = tl.arange(0, CAP)
                vec = tl.load(slots + k, mask=k < n, other=0.0)
                j = tl.arange(0, NC).to(tl.int64)
                while lo < hi:
                    cand_bits = lo + (hi - lo) * j // NC
                    cand = cand_bits.to(tl.int32).to(tl.float32, bitcast=True)
                    s = a + tl.sum(tl.where(vec[None, :] > cand[:, None], vec[None, :], 0.0), axis=1)
                    lo, hi = _narrow(lo, hi, cand_bits, s < target)
        while lo < hi:  # when the interval's values did not fit the slots
            lo, hi = _row_pass(base, V, inv_t, m, lo, hi, target, BLOCK, NC, LOGITS)
    tl.store(cut_ptr + row, lo.to(tl.int32).to(tl.float32, bitcast=True))


@triton.jit
def _uniform(seed, quads, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """``[ROWS, BLOCK]`` uniforms in [0, 1): token ``4q + i`` takes the i-th of the four values
    Philox gives counter ``q`` (``quads``: ``[ROWS, BLOCK // 4]``) under the row's seed, so a
    token's value depends only on the seed and its id (not on the tile width)."""
    r0, r1, r2, r3 = tl.rand4x(seed, quads.to(tl.int32))
    pairs = tl.join(tl.join(r0, r1), tl.join(r2, r3))  # [ROWS, BLOCK // 4, 2, 2]: (q, i // 2, i % 2)
    return tl.reshape(pairs, [ROWS, BLOCK])


@triton.jit(do_not_specialize=["R", "V", "stride"])
def _race_kernel(x_ptr, inv_t_ptr, m_ptr, cut_ptr, seed_ptr, out_ptr, R, V, stride,
                 ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """``ROWS`` rows per program, one pass: the kept token (``u >= cut``) with the largest
    ``u / E`` where ``E = -log(1 - U)`` is Exp(1) noise and ``U`` = ``tl.rand(seed, token)``:
    the exponential race, which draws token i with probability u_i / (the kept u's sum). The
    noise of a row depends only on its seed and the token ids."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    live = rows < R
    inv_t = tl.load(inv_t_ptr + rows, mask=live, other=1.0)[:, None]
    m = tl.load(m_ptr + rows, mask=live, other=0.0)[:, None]
    cut = tl.load(cut_ptr + rows, mask=live, other=2.0)[:, None]
    seed = tl.load(seed_ptr + rows, mask=live, other=0)[:, None]
    cols = tl.arange(0, BLOCK)
    quad = tl.arange(0, BLOCK // 4)
    best = tl.full([ROWS], -1.0, tl.float32)
    best_i = tl.zeros([ROWS], tl.int64)
    for start in range(0, V, BLOCK):
        tok = start + cols
        ok = live[:, None] & (tok < V)[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride + tok[None, :], mask=ok, other=float("-inf"))
        u = _unnormalized(x, inv_t, m)
        noise = -tl.log(1.0 - _uniform(seed, start // 4 + quad[None, :] + 0 * rows[:, None], ROWS, BLOCK))
        score = tl.where(ok & (u >= cut) & (u > 0.0), u / noise, -1.0)
        top = tl.max(score, axis=1)
        arg = tl.argmax(score, axis=1).to(tl.int64) + start
        better = top > best
        best_i = tl.where(better, arg, best_i)
        best = tl.where(better, top, best)
    tl.store(out_ptr + rows, best_i, mask=live)


RACE_ROWS_INTERPRETED = 256
"""Rows per race program under Triton's CPU interpreter (numpy runs a program's tile at once);
on a GPU one row per program."""


def top_p_threshold(probs: torch.Tensor, top_p: torch.Tensor, *, block: int | None = None,
                    full_passes: int | None = None, cap: int | None = None) -> torch.Tensor:
    """Per row of ``probs`` (float32 ``[R, V]``, unit last stride, non-negative, each row summing
    to about 1), the float32 tau such that the row's top-``top_p`` kept set (``top_p``: float32
    ``[R]``) is exactly ``probs >= tau`` (see the module docstring). Rows with ``top_p >= 1``
    get 0.0 (keep everything) without reading the row. One launch; CUDA-graph safe."""
    R, V = probs.shape
    block, full_passes, cap = block or _BLOCK, FULL_PASSES if full_passes is None else full_passes, cap or CAP
    assert probs.dtype == top_p.dtype == torch.float32 and probs.stride(1) == 1 and top_p.shape == (R,)
    out = torch.empty(R, dtype=torch.float32, device=probs.device)
    if R:
        scratch = torch.empty(R, cap, dtype=torch.float32, device=probs.device)
        _threshold_kernel[(R,)](probs, top_p, top_p.contiguous(), out, out, scratch, V, probs.stride(0), BLOCK=block,
                                NC=CANDIDATES, LOGITS=False, FULL_PASSES=full_passes, CAP=cap,
                                num_warps=_NUM_WARPS)
    return out


def logit_threshold(x: torch.Tensor, inv_t: torch.Tensor, top_p: torch.Tensor, *, block: int | None = None,
                    full_passes: int | None = None, cap: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of logits ``x`` ([R, V], unit last stride, any float dtype) with inverse
    temperatures ``inv_t`` and ``top_p`` (float32 [R]): ``(cut, m)``, float32 [R]: ``m`` the
    row's maximum of ``x * inv_t`` and ``cut`` the top-p threshold in the scale of
    ``u = exp(x * inv_t - m)`` (0.0 where ``top_p >= 1``). One launch, no host sync."""
    R, V = x.shape
    block, full_passes, cap = block or _BLOCK, FULL_PASSES if full_passes is None else full_passes, cap or CAP
    assert x.stride(1) == 1 and inv_t.shape == top_p.shape == (R,)
    cut = torch.empty(R, dtype=torch.float32, device=x.device)
    m = torch.empty(R, dtype=torch.float32, device=x.device)
    if R:
        scratch = torch.empty(R, cap, dtype=torch.float32, device=x.device)
        _threshold_kernel[(R,)](x, inv_t.contiguous(), top_p.contiguous(), cut, m, scratch, V, x.stride(0),
                                BLOCK=block, NC=CANDIDATES, LOGITS=True, FULL_PASSES=full_passes, CAP=cap,
                                num_warps=_NUM_WARPS)
    return cut, m


def top_p_sample(x: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                 seeds: torch.Tensor, *, block: int | None = None) -> torch.Tensor:
    """One token per row of logits ``x`` ([R, V]; bf16 or float32), drawn from
    its softmax at ``temperature`` after top-p and min-p (float32 [R] each; 1.0 / 0.0 turn them
    off), with the noise of int64 ``seeds`` [R]: two launches (threshold, race), no
    vocabulary-sized temporaries, no host sync. The kept set is the threshold's (``probs >=
    tau``, see the module docstring) intersected with min-p's ``probs >= min_p * max``."""
    R, V = x.shape
    block = block or _BLOCK
    x = x if x.stride(1) == 1 else x.contiguous()
    inv_t = (1.0 / temperature.float()).contiguous()
    cut, m = logit_threshold(x, inv_t, top_p.float(), block=block)
    cut = torch.maximum(cut, min_p.float())  # u = probs / max: min-p's cut is min_p itself
    out = torch.empty(R, dtype=torch.long, device=x.device)
    interpreted = triton.knobs.runtime.interpret
    rows = RACE_ROWS_INTERPRETED if interpreted else 1
    width = max(16, min(block, triton.next_power_of_2(V))) if interpreted else RACE_BLOCK
    if R:
        _race_kernel[(triton.cdiv(R, rows),)](x, inv_t, m, cut, seeds.contiguous(), out, R, V, x.stride(0),
                                              ROWS=rows, BLOCK=width, num_warps=RACE_WARPS)
    return out


def top_p_threshold_reference(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """tau of ``top_p_threshold`` in float64 through a sort (for tests): the smallest of the row's
    probabilities (and 0) whose mass strictly above is below p; 0.0 where ``top_p >= 1``."""
    x = probs.double()
    asc = x.sort(dim=-1).values
    zero = torch.zeros_like(asc[:, :1])
    # above[:, i] = the sum of asc[:, i:]; the mass strictly above v starts at the first value > v
    above = torch.cat([asc.flip(-1).cumsum(-1).flip(-1), zero], dim=-1)
    cand = torch.cat([zero, asc], dim=-1)
    first_greater = torch.searchsorted(asc, cand, right=True)
    ok = above.gather(1, first_greater) < top_p.double()[:, None]
    tau = torch.where(ok, cand, torch.full_like(cand, float("inf"))).amin(dim=-1)
    return torch.where(top_p >= 1, torch.zeros_like(tau), tau).float()
