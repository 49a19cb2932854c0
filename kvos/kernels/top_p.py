"""Top-p and min-p sampling over the whole vocabulary in one kernel, by rejection: no sort, no
softmax tensor, no threshold search.

A row's top-p kept set is every token whose strictly more probable tokens weigh less than p (the
most probable token is always kept; tied tokens are kept or dropped together); min-p keeps the
tokens at least ``min_p`` times as probable as the most probable one, and the sampler keeps
their intersection. Both rules hold for any positive scaling of the row, so the kernel works on
``u = exp(x / T - m)`` (``m`` the row's maximum of ``x / T``: u is the probability times the
softmax's normaliser, 1 at the maximum) straight from the logits, as the model produced them.

Membership of one token is cheap to test (one pass: the mass of the u strictly above it), and
the kept set is a prefix of the tokens ordered by u, so the kernel draws a token from a superset
and tests it; a rejected token bounds the kept set from below, so the next draw comes from a
smaller superset (FlashInfer's rejection sampling, here with the inverse CDF in token order
rather than a per-token race: one uniform per round instead of per-token noise). The rounds'
uniforms come from Philox under one seed per row, so a seeded row's tokens depend only on its
seed. See ``_nucleus_kernel`` for the contract and its limits.

No host synchronisation; row counts, lengths and strides are ``do_not_specialize``, so one
compiled variant serves every batch. Import only where triton is installed.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvos.kernels.tile_attention import _interpreter_index_fix

if triton.knobs.runtime.interpret:
    _interpreter_index_fix()  # the loops' bounds are runtime values


@triton.jit
def _unnormalized(x, inv_t, m):
    """``exp(x / T - m)``: a token's probability times the row's normaliser, in (0, 1] (1 at the
    row's maximum). Every pass computes it through this one expression, so the value a token is
    drawn with is the value its membership is tested with."""
    return tl.exp(x.to(tl.float32) * inv_t - m)


@triton.jit
def _tile(x_ptr, rows, live, stride, start, cols, V, inv_t, m):
    """``_unnormalized`` over tokens ``start + cols`` of ``rows`` ([ROWS, BLOCK]; 0.0 past a row's
    end and on dead rows)."""
    ok = live[:, None] & (start + cols < V)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride + (start + cols)[None, :], mask=ok, other=0.0)
    return tl.where(ok, _unnormalized(x, inv_t[:, None], m[:, None]), 0.0)


@triton.jit(do_not_specialize=["R", "V", "stride"])
def _nucleus_kernel(x_ptr, inv_t_ptr, top_p_ptr, min_p_ptr, seed_ptr, out_ptr, R, V, stride,
                    ROWS: tl.constexpr, BLOCK: tl.constexpr, MAX_ROUNDS: tl.constexpr):
    """``ROWS`` rows per program (1 on a GPU): per row, a token of the kept set K (top-p's
    ``S(u) < p * sum(u)`` and min-p's ``u >= min_p``, ``u = _unnormalized(x)``, S(v) the sum of
    the row's u strictly above v) drawn with probability proportional to u, by rejection.

    Each round draws w from ``{u >= lo}`` by inverse CDF in token order: one uniform, and a pass
    that stops at the block where the running mass crosses it. One more pass computes S(u_w): w
    is in K iff S(u_w) < p * sum (min-p already holds: ``lo`` starts at min_p). A rejected w has
    u_w below every kept u, so the next round draws from ``{u > u_w}``, still a superset of K,
    whose mass is the S just computed. Conditioned on landing in K, every round draws from u
    restricted to K, so the accepted token does too. The row's maximum is never rejected
    (S = 0), and a rejection removes the excess mass above a point drawn from that excess (about
    half of it, on average): with p = 0.95 about 5% of rows need a second round. After
    ``MAX_ROUNDS`` the last draw stands.

    Masses are summed block by block in one fixed order, the same expression in every pass, so a
    crossing pass sees exactly the mass it was given (if the block's cumulative sum still falls
    short by rounding, the block's last positive token is taken); tokens whose mass above lies
    within float32 summation error of ``p * sum`` may be kept or dropped."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    live = rows < R
    inv_t = tl.load(inv_t_ptr + rows, mask=live, other=1.0)
    p = tl.load(top_p_ptr + rows, mask=live, other=1.0)
    lo = tl.load(min_p_ptr + rows, mask=live, other=0.0)  # a round draws from {u >= lo}; u = 1 at the max
    seed = tl.load(seed_ptr + rows, mask=live, other=0)
    cols = tl.arange(0, BLOCK)
    mx = tl.full([ROWS, BLOCK], float("-inf"), tl.float32)
    mi = tl.zeros([ROWS, BLOCK], tl.int32)
    for start in range(0, V, BLOCK):
        ok = live[:, None] & (start + cols < V)[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride + (start + cols)[None, :], mask=ok, other=float("-inf"))
        xs = x.to(tl.float32) * inv_t[:, None]
        better = xs > mx
        mi = tl.where(better, start + cols[None, :], mi)
        mx = tl.where(better, xs, mx)
    m = tl.where(live, tl.max(mx, axis=1), 0.0)
    top = tl.min(tl.where(mx == m[:, None], mi, V), axis=1).to(tl.int64)  # the row's (first) maximum
    total = tl.zeros([ROWS], tl.float32)
    mass = tl.zeros([ROWS], tl.float32)
    for start in range(0, V, BLOCK):
        v = _tile(x_ptr, rows, live, stride, start, cols, V, inv_t, m)
        total += tl.sum(v, axis=1)
        mass += tl.sum(tl.where(v >= lo[:, None], v, 0.0), axis=1)
    target = p * total
    w = top
    todo = live
    rnd = 0
    while (rnd < MAX_ROUNDS) & (tl.max(todo.to(tl.int32), axis=0) > 0):
        goal = tl.rand(seed, rnd + tl.zeros([ROWS], tl.int32)) * mass
        found = ~todo
        drawn = top  # if rounding leaves no crossing at all: the maximum
        run = tl.zeros([ROWS], tl.float32)
        start = 0
        while (start < V) & (tl.min(found.to(tl.int32), axis=0) == 0):
            v = _tile(x_ptr, rows, live, stride, start, cols, V, inv_t, m)
            k = tl.where(v >= lo[:, None], v, 0.0)
            block_mass = tl.sum(k, axis=1)
            cross = ~found & (run + block_mass > goal)
            if tl.max(cross.to(tl.int32), axis=0) > 0:
                before = run[:, None] + tl.cumsum(k, axis=1)
                i = tl.min(tl.where((before > goal[:, None]) & (k > 0.0), cols[None, :], BLOCK), axis=1)
                last = tl.max(tl.where(k > 0.0, cols[None, :], -1), axis=1)
                drawn = tl.where(cross, start + tl.where(i < BLOCK, i, last), drawn)
                found = found | cross
            run += block_mass
            start += BLOCK
        w = tl.where(todo, drawn, w)
        rnd += 1
        check = todo & (p < 1.0)
        if tl.max(check.to(tl.int32), axis=0) > 0:
            xw = tl.load(x_ptr + rows * stride + w, mask=live, other=0.0)
            uw = _unnormalized(xw, inv_t, m)
            above = tl.zeros([ROWS], tl.float32)
            for s in range(0, V, BLOCK):
                v = _tile(x_ptr, rows, live, stride, s, cols, V, inv_t, m)
                above += tl.sum(tl.where(v > uw[:, None], v, 0.0), axis=1)
            reject = check & (above >= target)
            lo = tl.where(reject, (uw.to(tl.int32, bitcast=True) + 1).to(tl.float32, bitcast=True), lo)
            mass = tl.where(reject, above, mass)
            todo = reject
        else:
            todo = check
    tl.store(out_ptr + rows, w, mask=live)

NUCLEUS_BLOCK = 8192
NUCLEUS_WARPS = 32
"""The tile of a row's pass: the fastest of ``benchmarks/scripts/top_p_kernels.py``'s sweep on an
H100 (figures: benchmarks/history.md, "top-p")."""
ROWS_INTERPRETED = 256
"""Rows per program under Triton's CPU interpreter (numpy runs a program's tile at once); on a
GPU one row per program."""
MAX_ROUNDS = 64


def nucleus_sample(x: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                   seeds: torch.Tensor, *, block: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """One token per row of logits ``x`` ([R, V], bf16 or float32) from its softmax at
    ``temperature`` after top-p and min-p (float32 [R] each; 1.0 / 0.0 turn them off), drawn
    with the int64 ``seeds`` [R] (one per row per step): one launch, no vocabulary-sized
    temporaries, no host sync."""
    R, V = x.shape
    x = x if x.stride(1) == 1 else x.contiguous()
    out = torch.empty(R, dtype=torch.long, device=x.device)
    interpreted = triton.knobs.runtime.interpret
    rows = ROWS_INTERPRETED if interpreted else 1
    if R:
        block = block or (min(NUCLEUS_BLOCK, max(16, triton.next_power_of_2(V))) if interpreted else NUCLEUS_BLOCK)
        _nucleus_kernel[(triton.cdiv(R, rows),)](
            x, (1.0 / temperature.float()).contiguous(), top_p.float().contiguous(), min_p.float().contiguous(),
            seeds.contiguous(), out, R, V, x.stride(0), ROWS=rows, BLOCK=block, MAX_ROUNDS=MAX_ROUNDS,
            num_warps=num_warps or NUCLEUS_WARPS)
    return out


@triton.jit(do_not_specialize=["R", "K"])
def _ranked_kernel(vals_ptr, order_ptr, params_ptr, seed_ptr, out_ptr, R, K, ROWS: tl.constexpr, KP: tl.constexpr):
    """``ROWS`` rows per program (1 on a GPU): a token of each row's top-k candidates (``vals``,
    descending, ``[R, K]`` logits, and their token ids ``order``) after temperature, top-k, top-p
    over the top-k survivors (a candidate is dropped when the mass of the better candidates
    reaches p; the first never is) and min-p, drawn by inverse CDF in rank order with one
    Philox uniform under the row's seed. ``params`` is float32 ``[4, R]``: temperature, top_k,
    top_p, min_p. If rounding leaves no crossing, the top candidate is taken."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    live = rows < R
    cols = tl.arange(0, KP)
    t = tl.load(params_ptr + rows, mask=live, other=1.0)
    k = tl.load(params_ptr + R + rows, mask=live, other=1.0).to(tl.int32)
    p = tl.load(params_ptr + 2 * R + rows, mask=live, other=1.0)
    min_p = tl.load(params_ptr + 3 * R + rows, mask=live, other=0.0)
    seed = tl.load(seed_ptr + rows, mask=live, other=0)
    keep = live[:, None] & (cols[None, :] < K) & (cols[None, :] < k[:, None])
    x = tl.load(vals_ptr + rows[:, None] * K + cols[None, :], mask=keep, other=0.0).to(tl.float32) / t[:, None]
    top = tl.max(tl.where(keep, x, float("-inf")), axis=1)
    e = tl.where(keep, tl.exp(x - top[:, None]), 0.0)  # the first candidate's is 1
    probs = e / tl.where(live, tl.sum(e, axis=1), 1.0)[:, None]  # dead rows: no 0 / 0
    before = tl.cumsum(probs, axis=1) - probs
    keep &= (p[:, None] >= 1.0) | (before < p[:, None]) | (cols[None, :] == 0)
    keep &= e >= min_p[:, None]  # min-p against the first candidate's 1
    e = tl.where(keep, e, 0.0)
    goal = tl.rand(seed, tl.zeros([ROWS], tl.int32)) * tl.sum(e, axis=1)
    i = tl.min(tl.where((tl.cumsum(e, axis=1) > goal[:, None]) & (e > 0.0), cols[None, :], KP), axis=1)
    i = tl.where(i < KP, i, 0)
    tl.store(out_ptr + rows, tl.load(order_ptr + rows * K + i, mask=live, other=0), mask=live)


def ranked_sample(vals: torch.Tensor, order: torch.Tensor, params: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """One token per row from its top-k candidates (``vals``: logits sorted descending, any float
    dtype, ``[R, K]``; ``order``: their int64 token ids), ``params`` float32 ``[4, R]``
    (temperature, top_k, top_p, min_p; top_k <= K), one int64 seed per row: one launch."""
    R, K = vals.shape
    out = torch.empty(R, dtype=torch.long, device=vals.device)
    rows = ROWS_INTERPRETED if triton.knobs.runtime.interpret else 1
    if R:
        _ranked_kernel[(triton.cdiv(R, rows),)](vals.contiguous(), order.contiguous(), params.contiguous(),
                                                seeds.contiguous(), out, R, K, ROWS=rows,
                                                KP=max(16, triton.next_power_of_2(K)), num_warps=4)
    return out
