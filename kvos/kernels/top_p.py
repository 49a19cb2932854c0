"""Top-p (nucleus) filtering without a sort: an exact per-row probability threshold.

A row's top-p kept set is every token whose strictly more probable tokens weigh less than p
(the most probable token is always kept; tied tokens are kept or dropped together). With
``S(v)`` = the sum of the row's probabilities strictly greater than v, S is non-increasing and
only steps down at the row's probabilities, so the kept set is exactly ``probs >= tau`` where
``tau`` = the smallest float ``v >= 0`` with ``S(v) < p``: one of the row's probabilities (or 0
when even ``S(0) < p``: everything is kept).

The kernel finds tau by searching the int32 bit patterns of the non-negative floats, which are
ordered like the floats themselves, between 0 and the row's maximum (``S(max) = 0 < p``). Each
pass over the row evaluates S at ``CANDIDATES`` bit patterns spread over the interval at once
and keeps the sub-interval where ``S < p`` starts, so a pass shrinks the interval
``CANDIDATES``-fold: probabilities are at most 1.0 (bit pattern < 2**30), so 10 passes after the
max pass reach a single pattern (8 with 16 candidates). S is summed in float32 in one fixed order
for every candidate of every pass, and a float sum of non-negative terms can only shrink when
terms are zeroed, so the computed S is non-increasing too and the search is consistent; tau
differs from the float64 rule only for tokens whose mass above lies within float32 summation
error of p. (``p <= 0``, which ``SamplingParams`` refuses, would keep the maximum alone.)

No host synchronisation; the row length and stride are ``do_not_specialize``, so one compiled
variant serves every batch. Import only where triton is installed.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvos.kernels.tile_attention import _interpreter_index_fix

# Tokens one block of the row holds, and thresholds evaluated per pass: each block step builds a
# [CANDIDATES, BLOCK] comparison, accumulated elementwise and reduced once per pass. The work per
# token is CANDIDATES compare-select-adds a pass, so fewer candidates and more passes win while
# the passes stay cheap next to memory: on an H100 with 256 rows of 128256 tokens, 8 candidates
# (2048-token blocks, 16 warps) took 0.62 ms, 16 candidates 0.89 ms at best, 4 candidates 0.78 ms.
_BLOCK = 2048
_NUM_WARPS = 16
CANDIDATES = 8

if triton.knobs.runtime.interpret:
    _interpreter_index_fix()  # the loops' bounds are runtime values


@triton.jit(do_not_specialize=["V", "stride"])
def _top_p_threshold_kernel(probs_ptr, top_p_ptr, out_ptr, V, stride,
                            BLOCK: tl.constexpr, NC: tl.constexpr):
    """One program per row. Invariant of the search over bit patterns [lo, hi]: S < p at hi, and
    S >= p at every pattern below lo, so tau's pattern lies in [lo, hi]."""
    row = tl.program_id(0).to(tl.int64)
    base = probs_ptr + row * stride
    p = tl.load(top_p_ptr + row)
    cols = tl.arange(0, BLOCK)
    n = tl.where(p < 1.0, V, 0)  # p >= 1 keeps everything: no pass at all, tau = 0.0
    m = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n, BLOCK):
        x = tl.load(base + start + cols, mask=start + cols < V, other=0.0)
        m = tl.maximum(m, x)
    lo = tl.zeros([], tl.int64)
    hi = tl.max(m, axis=0).to(tl.int32, bitcast=True).to(tl.int64)
    j = tl.arange(0, NC).to(tl.int64)
    while lo < hi:
        # NC patterns in [lo, hi): lo + floor((hi - lo) * j / NC), int64 so the product cannot overflow
        cand_bits = lo + (hi - lo) * j // NC
        cand = cand_bits.to(tl.int32).to(tl.float32, bitcast=True)
        acc = tl.zeros([NC, BLOCK], tl.float32)
        for start in range(0, V, BLOCK):
            x = tl.load(base + start + cols, mask=start + cols < V, other=0.0)
            acc += tl.where(x[None, :] > cand[:, None], x[None, :], 0.0)
        below = tl.sum(acc, axis=1) < p  # non-decreasing in j
        # tau is in (the last candidate with S >= p, the first with S < p]
        hi = tl.min(tl.where(below, cand_bits, hi), axis=0)
        lo = tl.max(tl.where(below, lo, cand_bits + 1), axis=0)
    tl.store(out_ptr + row, lo.to(tl.int32).to(tl.float32, bitcast=True))


def top_p_threshold(probs: torch.Tensor, top_p: torch.Tensor, *, block: int = _BLOCK) -> torch.Tensor:
    """Per row of ``probs`` (float32 ``[R, V]``, unit last stride, non-negative, each row summing
    to about 1), the float32 tau such that the row's top-``top_p`` kept set (``top_p``: float32
    ``[R]``) is exactly ``probs >= tau`` (see the module docstring). Rows with ``top_p >= 1``
    get 0.0 (keep everything) without reading the row. One launch; CUDA-graph safe."""
    R, V = probs.shape
    assert probs.dtype == top_p.dtype == torch.float32 and probs.stride(1) == 1 and top_p.shape == (R,)
    top_p = top_p.contiguous()
    out = torch.empty(R, dtype=torch.float32, device=probs.device)
    if R:
        _top_p_threshold_kernel[(R,)](probs, top_p, out, V, probs.stride(0), BLOCK=block,
                                      NC=CANDIDATES, num_warps=_NUM_WARPS)
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
