"""The selective scan of a step's Mamba2 prefill rows in chunks (state-space duality), in three
Triton kernels over every prefill sequence of the step at once.

Each sequence's new tokens are cut into chunks of at most ``CHUNK`` tokens that end at its save
points (``SeqStates.saves``), so that the state after a chunk is the state a save asks for.
Per chunk and head, with ``cs`` the running sum of ``dt A`` inside the chunk:

0. ``_chunk_cb_kernel``: ``C_t . B_s`` per chunk and group (heads of a group share it), in
   ``TILE x TILE`` tiles;
1. ``_chunk_state_kernel``: the chunk's own contribution to the state, ``sum_s exp(cs_end -
   cs_s) dt_s x_s B_s^T`` ``[P, N]``, and its total decay ``cs_end``;
2. ``_state_pass_kernel``: per sequence, in chunk order, the state entering each chunk
   (``h_c = exp(cs_end_{c-1}) h_{c-1} + own_{c-1}``, from the read block's state or zeros),
   into a buffer of its own (written over the chunk's own contribution, the loop ran at a third
   of the speed: every store waited for the load of the same address), and the states at save
   points written into their blocks;
3. ``_chunk_scan_kernel``: ``y_t = exp(cs_t) C_t h_c + sum_{s<=t} (C_t . B_s) exp(cs_t - cs_s)
   dt_s x_s + D x_t``.

Float32 throughout, but for the matrix products' operands: bfloat16 (float32 sums) unless
``exact`` (float32 models: IEEE float32, the CPU path's precision); unless exact, x, B and C
may come in bfloat16 (the convolution's output, as transformers' and mamba_ssm's), which halves
their reads and lets the products' operands go to shared memory without a conversion. Safety:
the blocks named must be referenced for the whole step and no two sequences may write the same block
(``StateMetadata``'s rule); a sequence's read block may be one of its save blocks (each program
reads its tile of the state before writing it). No host synchronisation beyond building the
chunk table from host lists.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvos.kernels.mamba_update import softplus

CHUNK = 256
"""Tokens per chunk (a multiple of ``TILE``): the states between chunks are the scan's memory
traffic (one ``[H, P, N]`` float32 state per chunk, written and read twice), the quadratic part
grows with it."""
TILE = 64
"""Rows of a chunk one program handles at a time."""
# Tiles, warps and stages per kernel: the fastest of sweeps on an H200 at Bamba-9B's layer shape
# (benchmarks/scripts/mamba_scan_gpu.py); module constants so that a sweep can set them.
_BLOCK_N = 64
_STATE_BLOCK_N = 128
_STATE_WARPS = 4
_SCAN_WARPS = 4
_SCAN_STAGES = 3
_STATE_STAGES = 1
_CONV_ROWS = 16
_CONV_CHANNELS = 128
_CONV_WARPS = 4
_PASS_BLOCK = 1024
_PASS_WARPS = 4


@dataclass
class ScanChunks:
    """The step's chunk table on the device: per chunk its first row, length and the block its
    end state is saved into (-1: none); per sequence its first chunk, chunk count and the
    block its state is read from (-1: zeros)."""

    start: torch.Tensor
    length: torch.Tensor
    save: torch.Tensor
    seq_first: torch.Tensor
    seq_count: torch.Tensor
    seq_read: torch.Tensor

    @property
    def num_chunks(self) -> int:
        return self.start.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.seq_first.shape[0]


def scan_chunks(seqs, row0: int, device: torch.device, chunk: int = CHUNK) -> ScanChunks:
    """The chunk table of ``seqs`` (``SeqStates`` of prefills, rows counted from ``row0``): each
    save point ends a chunk, and the tokens before it (from the previous one) are cut into
    chunks of ``chunk`` from their start."""
    start, length, save, first, count, read = [], [], [], [], [], []
    for q in seqs:
        first.append(len(start))
        read.append(q.read_block)
        lo = 0
        for b, block in q.saves:
            while b - lo > chunk:
                start.append(q.row - row0 + lo)
                length.append(chunk)
                save.append(-1)
                lo += chunk
            start.append(q.row - row0 + lo)
            length.append(b - lo)
            save.append(block)
            lo = b
        count.append(len(start) - first[-1])
    t = torch.tensor([start, length, save], dtype=torch.int32).to(device, non_blocking=True)
    s = torch.tensor([first, count, read], dtype=torch.int32).to(device, non_blocking=True)
    return ScanChunks(t[0], t[1], t[2], s[0], s[1], s[2])


@triton.jit
def _dot(a, b, acc, EXACT: tl.constexpr):
    """``acc + a @ b``: IEEE float32 when EXACT, else with bfloat16 operands (float32 sums)."""
    if EXACT:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), acc)


@triton.jit
def _decay_before(dt_ptr, start, n, h, a, sdt, L: tl.constexpr):
    """The sum of ``dt A`` over the chunk's first ``n`` rows."""
    t = tl.arange(0, L)
    dt = tl.load(dt_ptr + (start + t).to(tl.int64) * sdt + h, mask=t < n, other=0.0)
    return tl.sum(dt * a, axis=0)


@triton.jit
def _tile_decay(dt_ptr, start, length, j, h, a, before, sdt, TB: tl.constexpr):
    """(rows, their mask, dt, the running sum of dt A from the chunk's start) for the chunk's rows
    ``[j, j + TB)``, given ``before``, the sum over its rows before ``j``."""
    t = j + tl.arange(0, TB)
    tm = t < length
    dt = tl.load(dt_ptr + (start + t).to(tl.int64) * sdt + h, mask=tm, other=0.0)
    return t, tm, dt, before + tl.cumsum(dt * a, axis=0)


@triton.jit
def _chunk_cb_kernel(
    b_ptr, c_ptr, start_ptr, len_ptr, cb_ptr,
    sb_t, sb_g, sc_t, sc_g, G,
    N: tl.constexpr, L: tl.constexpr, TB: tl.constexpr, BN: tl.constexpr, EXACT: tl.constexpr,
):
    c = tl.program_id(0)
    g = tl.program_id(1)
    tb = tl.program_id(2) // (L // TB)
    sb = tl.program_id(2) % (L // TB)
    start = tl.load(start_ptr + c)
    length = tl.load(len_ptr + c)
    t = tb * TB + tl.arange(0, TB)
    s = sb * TB + tl.arange(0, TB)
    tm = (t < length) & (sb <= tb)
    sm = (s < length) & (sb <= tb)
    acc = tl.zeros((TB, TB), dtype=tl.float32)
    for k0 in range(0, N, BN):
        k = k0 + tl.arange(0, BN)
        cm = tl.load(c_ptr + (start + t).to(tl.int64)[:, None] * sc_t + g * sc_g + k[None, :],
                     mask=tm[:, None] & (k < N)[None, :], other=0.0)
        bm = tl.load(b_ptr + (start + s).to(tl.int64)[:, None] * sb_t + g * sb_g + k[None, :],
                     mask=sm[:, None] & (k < N)[None, :], other=0.0)
        acc = _dot(cm, tl.trans(bm), acc, EXACT)
    out = cb_ptr + (c.to(tl.int64) * G + g) * (L * L)
    tl.store(out + t[:, None] * L + s[None, :], acc)


@triton.jit
def _chunk_state_kernel(
    x_ptr, dt_ptr, a_ptr, b_ptr, start_ptr, len_ptr, st_ptr, decay_ptr,
    sx_t, sx_h, sdt, sb_t, sb_g, H, heads_per_group,
    P: tl.constexpr, N: tl.constexpr, L: tl.constexpr, TB: tl.constexpr, BP: tl.constexpr,
    BN: tl.constexpr, EXACT: tl.constexpr,
):
    nb = tl.program_id(0)  # fastest: the programs sharing a chunk's x run together (L2)
    h = tl.program_id(1)
    c = tl.program_id(2)
    start = tl.load(start_ptr + c)
    length = tl.load(len_ptr + c)
    a = tl.load(a_ptr + h)
    total = _decay_before(dt_ptr, start, length, h, a, sdt, L)
    p = tl.arange(0, BP)
    n = nb * BN + tl.arange(0, BN)
    g = h // heads_per_group
    acc = tl.zeros((BP, BN), dtype=tl.float32)
    before = total * 0.0
    for j in range(0, L, TB):
        t, tm, dt, cs = _tile_decay(dt_ptr, start, length, j, h, a, before, sdt, TB)
        before += tl.sum(dt * a, axis=0)
        w = tl.where(tm, dt * tl.exp(total - cs), 0.0)
        rows = (start + t).to(tl.int64)
        x = tl.load(x_ptr + rows[:, None] * sx_t + h * sx_h + p[None, :], mask=tm[:, None] & (p < P)[None, :],
                    other=0.0).to(tl.float32)
        b = tl.load(b_ptr + rows[:, None] * sb_t + g * sb_g + n[None, :], mask=tm[:, None] & (n < N)[None, :],
                    other=0.0)
        acc = _dot(tl.trans(x * w[:, None]), b, acc, EXACT)  # [BP, BN]
    out = st_ptr + (c.to(tl.int64) * H + h) * (P * N)
    tl.store(out + p[:, None] * N + n[None, :], acc, mask=(p < P)[:, None] & (n < N)[None, :])
    if nb == 0:
        tl.store(decay_ptr + c * H + h, total)


@triton.jit
def _state_pass_kernel(
    st_ptr, prev_ptr, decay_ptr, ssm_ptr, save_ptr, first_ptr, count_ptr, read_ptr,
    s_blk, s_head, H,
    PN: tl.constexpr, BLOCK: tl.constexpr,
):
    s = tl.program_id(0)
    h = tl.program_id(1)
    e = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    em = e < PN
    first = tl.load(first_ptr + s)
    count = tl.load(count_ptr + s)
    read = tl.load(read_ptr + s).to(tl.int64)
    state = tl.load(ssm_ptr + tl.maximum(read, 0) * s_blk + h * s_head + e, mask=em & (read >= 0), other=0.0)
    c = first.to(tl.int64)
    while c < first + count:  # a while loop: the interpreter cannot range over a loaded count
        at = st_ptr + (c * H + h) * PN + e
        own = tl.load(at, mask=em, other=0.0)
        tl.store(prev_ptr + (c * H + h) * PN + e, state.to(prev_ptr.dtype.element_ty), mask=em)
        state = tl.exp(tl.load(decay_ptr + c * H + h)) * state + own
        save = tl.load(save_ptr + c).to(tl.int64)
        tl.store(ssm_ptr + tl.maximum(save, 0) * s_blk + h * s_head + e, state, mask=em & (save >= 0))
        c += 1


@triton.jit
def _chunk_scan_kernel(
    x_ptr, dt_ptr, a_ptr, c_ptr, d_ptr, start_ptr, len_ptr, prev_ptr, cb_ptr, y_ptr,
    sx_t, sx_h, sdt, sc_t, sc_g, sy_t, sy_h, H, G, heads_per_group,
    P: tl.constexpr, N: tl.constexpr, L: tl.constexpr, TB: tl.constexpr, BP: tl.constexpr,
    BN: tl.constexpr, EXACT: tl.constexpr,
):
    m = tl.program_id(0) * TB  # the first of this program's rows in the chunk; fastest: the
    h = tl.program_id(1)       # programs reading a chunk's entering state run together (L2)
    c = tl.program_id(2)
    start = tl.load(start_ptr + c)
    length = tl.load(len_ptr + c)
    a = tl.load(a_ptr + h)
    t, tm, dt_t, cs_t = _tile_decay(dt_ptr, start, length, m, h, a,
                                    _decay_before(dt_ptr, start, tl.minimum(m, length), h, a, sdt, L), sdt, TB)
    rows = (start + t).to(tl.int64)
    p = tl.arange(0, BP)
    pm = p < P
    g = h // heads_per_group
    prev = prev_ptr + (c.to(tl.int64) * H + h) * (P * N)
    acc = tl.zeros((TB, BP), dtype=tl.float32)
    for k0 in range(0, N, BN):  # the state entering the chunk, read through C
        k = k0 + tl.arange(0, BN)
        km = k < N
        cm = tl.load(c_ptr + rows[:, None] * sc_t + g * sc_g + k[None, :], mask=tm[:, None] & km[None, :], other=0.0)
        hm = tl.load(prev + p[:, None] * N + k[None, :], mask=pm[:, None] & km[None, :], other=0.0)
        acc = _dot(cm, tl.trans(hm), acc, EXACT)
    acc = acc * tl.exp(cs_t)[:, None]
    cb = cb_ptr + (c.to(tl.int64) * G + g) * (L * L)
    before = a * 0.0
    j = m * 0
    while j <= m:  # the chunk's rows up to this program's, a tile at a time
        s, sm, dt_s, cs_s = _tile_decay(dt_ptr, start, length, j, h, a, before, sdt, TB)
        before += tl.sum(dt_s * a, axis=0)
        causal = (t[:, None] >= s[None, :]) & sm[None, :]
        scores = tl.load(cb + t[:, None] * L + s[None, :]) * tl.exp(tl.where(causal, cs_t[:, None] - cs_s[None, :],
                                                                             float("-inf")))
        xs = tl.load(x_ptr + (start + s).to(tl.int64)[:, None] * sx_t + h * sx_h + p[None, :],
                     mask=sm[:, None] & pm[None, :], other=0.0)
        acc = _dot(scores * dt_s[None, :], xs, acc, EXACT)
        j += TB
    x = tl.load(x_ptr + rows[:, None] * sx_t + h * sx_h + p[None, :], mask=tm[:, None] & pm[None, :], other=0.0)
    acc += tl.load(d_ptr + h) * x.to(tl.float32)
    tl.store(y_ptr + rows[:, None] * sy_t + h * sy_h + p[None, :], acc, mask=tm[:, None] & pm[None, :])


def chunked_scan(chunks: ScanChunks, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                 C: torch.Tensor, D: torch.Tensor, ssm: torch.Tensor, y: torch.Tensor, exact: bool = False,
                 chunk: int = CHUNK, tile: int = TILE) -> None:
    """The scan of ``chunks`` (built with the same ``chunk``, a multiple of ``tile``): x ``[T, H,
    P]``, dt ``[T, H]`` (after softplus), A/D ``[H]``, B and C ``[T, G, N]`` (heads share their
    group's), with unit stride on the last dimension; dt, A, D float32, x, B and C float32 or,
    unless ``exact``, bfloat16 (the products' operands are rounded to it anyway); ssm ``[blocks,
    H, P, N]`` (contiguous per head): read at each sequence's read block, written at its save
    blocks; y ``[T, H, P]`` float32, written (without the gate)."""
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    assert not exact or x.dtype == B.dtype == C.dtype == torch.float32, "exact needs float32 x, B and C"
    assert ssm.stride(3) == 1 and ssm.stride(2) == N and x.stride(2) == 1 and B.stride(2) == 1 and C.stride(2) == 1
    assert y.stride(2) == 1 and dt.stride(1) == 1 and H % G == 0 and chunk % tile == 0 and tile >= 16
    nc = chunks.num_chunks
    if nc == 0:
        return
    BP = max(16, triton.next_power_of_2(P))
    BN = min(_BLOCK_N, max(16, triton.next_power_of_2(N)))
    tiles = chunk // tile
    st = torch.empty(nc, H, P, N, dtype=torch.float32, device=x.device)
    decay = torch.empty(nc, H, dtype=torch.float32, device=x.device)
    cb = torch.empty(nc, G, chunk, chunk, dtype=torch.float32, device=x.device)
    _chunk_cb_kernel[(nc, G, tiles * tiles)](
        B, C, chunks.start, chunks.length, cb, B.stride(0), B.stride(1), C.stride(0), C.stride(1), G,
        N=N, L=chunk, TB=tile, BN=BN, EXACT=exact, num_warps=4)
    BNS = min(_STATE_BLOCK_N, max(16, triton.next_power_of_2(N)))
    _chunk_state_kernel[(triton.cdiv(N, BNS), H, nc)](
        x, dt, A, B, chunks.start, chunks.length, st, decay,
        x.stride(0), x.stride(1), dt.stride(0), B.stride(0), B.stride(1), H, H // G,
        P=P, N=N, L=chunk, TB=tile, BP=BP, BN=BNS, EXACT=exact, num_warps=_STATE_WARPS,
        num_stages=_STATE_STAGES)
    # The state entering each chunk is only a matrix product's operand: bfloat16 unless exact
    # (the product rounds it to that anyway), half the bytes written and read.
    prev = torch.empty_like(st, dtype=torch.float32 if exact else torch.bfloat16)
    _state_pass_kernel[(chunks.num_seqs, H, triton.cdiv(P * N, _PASS_BLOCK))](
        st, prev, decay, ssm, chunks.save, chunks.seq_first, chunks.seq_count, chunks.seq_read,
        ssm.stride(0), ssm.stride(1), H, PN=P * N, BLOCK=_PASS_BLOCK, num_warps=_PASS_WARPS)
    _chunk_scan_kernel[(tiles, H, nc)](
        x, dt, A, C, D, chunks.start, chunks.length, prev, cb, y,
        x.stride(0), x.stride(1), dt.stride(0), C.stride(0), C.stride(1), y.stride(0), y.stride(1), H, G, H // G,
        P=P, N=N, L=chunk, TB=tile, BP=BP, BN=BN, EXACT=exact, num_warps=_SCAN_WARPS,
        num_stages=_SCAN_STAGES)


@triton.jit
def _prefill_dt_kernel(raw_ptr, bias_ptr, out_ptr, T, H, s_raw, lo, hi, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < T * H
    t, h = i // H, i % H
    v = tl.load(raw_ptr + t.to(tl.int64) * s_raw + h, mask=m, other=0.0).to(tl.float32)
    v += tl.load(bias_ptr + h, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + i, tl.minimum(tl.maximum(softplus(v), lo), hi), mask=m)


def prefill_dt(dt_raw: torch.Tensor, dt_bias: torch.Tensor, dt_range: tuple[float, float]) -> torch.Tensor:
    """The prefill rows' discretisation steps ``clamp(softplus(dt_raw + dt_bias), *dt_range)`` in
    one kernel (torch's form is five): dt_raw ``[T, H]`` (any float dtype, unit stride on heads),
    dt_bias ``[H]``; returns ``[T, H]`` float32, contiguous."""
    T, H = dt_raw.shape
    assert dt_raw.stride(1) == 1 and dt_bias.is_contiguous()
    out = torch.empty(T, H, dtype=torch.float32, device=dt_raw.device)
    if T:
        _prefill_dt_kernel[(triton.cdiv(T * H, 1024),)](dt_raw, dt_bias, out, T, H, dt_raw.stride(0),
                                                        float(dt_range[0]), float(dt_range[1]), BLOCK=1024)
    return out


@dataclass
class ConvRows:
    """The prefill rows' causal-convolution table on the device: per row, the row of its
    sequence's first new token and the block holding the inputs before it (-1: zeros); per save
    point, the sequence's first row, the save's position in it, the read block and the block the
    window is written into."""

    seq_row: torch.Tensor
    read: torch.Tensor
    saves: torch.Tensor  # [4, num_saves]


def conv_rows(seqs, row0: int, device: torch.device) -> ConvRows:
    """The convolution table of ``seqs`` (``SeqStates`` of prefills, rows counted from ``row0``)."""
    seq_row, read, saves = [], [], [[], [], [], []]
    for q in seqs:
        seq_row += [q.row - row0] * q.num_tokens
        read += [q.read_block] * q.num_tokens
        for b, block in q.saves:
            for col, v in enumerate((q.row - row0, b, q.read_block, block)):
                saves[col].append(v)
    rows = torch.tensor([seq_row, read], dtype=torch.int32).to(device, non_blocking=True)
    return ConvRows(rows[0], rows[1], torch.tensor(saves, dtype=torch.int32).to(device, non_blocking=True))


@triton.jit
def _conv_input(x_ptr, conv_ptr, seq_row, read, j, ch, cm, sx_t, s_blk, s_ch, W: tl.constexpr):
    """Input ``j`` (``[BT]``, relative to each row's sequence start) of channels ``ch``: a new row
    for ``j >= 0``, else the read block's window (zeros without one)."""
    new = tl.load(x_ptr + (seq_row + tl.maximum(j, 0)).to(tl.int64)[:, None] * sx_t + ch[None, :],
                  mask=(j >= 0)[:, None] & cm[None, :], other=0.0).to(tl.float32)
    old = tl.load(conv_ptr + tl.maximum(read, 0).to(tl.int64)[:, None] * s_blk + ch[None, :] * s_ch
                  + (W + tl.minimum(j, -1))[:, None], mask=((j < 0) & (read >= 0))[:, None] & cm[None, :], other=0.0)
    return tl.where((j >= 0)[:, None], new, old)


@triton.jit
def _conv_prefill_kernel(
    x_ptr, conv_ptr, seq_row_ptr, read_ptr, w_ptr, bias_ptr, out_ptr,
    T, conv_dim, sx_t, s_blk, s_ch, sw_c, so_t,
    W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    r = tl.program_id(0) * BT + tl.arange(0, BT)
    ch = tl.program_id(1) * BC + tl.arange(0, BC)
    rm = r < T
    cm = ch < conv_dim
    seq_row = tl.load(seq_row_ptr + r, mask=rm, other=0)
    read = tl.load(read_ptr + r, mask=rm, other=-1)
    pos = r - seq_row
    acc = tl.zeros((BT, BC), dtype=tl.float32)
    for k in tl.static_range(W + 1):
        v = _conv_input(x_ptr, conv_ptr, seq_row, read, pos - W + k, ch, cm, sx_t, s_blk, s_ch, W)
        acc += v * tl.load(w_ptr + ch * sw_c + k, mask=cm, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + ch, mask=cm, other=0.0).to(tl.float32)[None, :]
    out = (acc * tl.sigmoid(acc)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + r.to(tl.int64)[:, None] * so_t + ch[None, :], out, mask=rm[:, None] & cm[None, :])


@triton.jit
def _conv_save_kernel(
    x_ptr, conv_ptr, saves_ptr, num_saves, conv_dim, sx_t, s_blk, s_ch,
    W: tl.constexpr, WP: tl.constexpr, BC: tl.constexpr,
):
    i = tl.program_id(0)
    ch = tl.program_id(1) * BC + tl.arange(0, BC)
    cm = ch < conv_dim
    seq_row = tl.load(saves_ptr + i)
    b = tl.load(saves_ptr + num_saves + i)
    read = tl.load(saves_ptr + 2 * num_saves + i)
    block = tl.load(saves_ptr + 3 * num_saves + i).to(tl.int64)
    k = tl.arange(0, WP)
    j = b - W + k  # [WP] the window's inputs, oldest first
    new = tl.load(x_ptr + (seq_row + tl.maximum(j, 0)).to(tl.int64)[None, :] * sx_t + ch[:, None],
                  mask=((j >= 0) & (k < W))[None, :] & cm[:, None], other=0.0).to(tl.float32)
    old = tl.load(conv_ptr + tl.maximum(read, 0).to(tl.int64) * s_blk + ch[:, None] * s_ch + (W + tl.minimum(j, -1))[None, :],
                  mask=((j < 0) & (k < W) & (read >= 0))[None, :] & cm[:, None], other=0.0)
    tl.store(conv_ptr + block * s_blk + ch[:, None] * s_ch + k[None, :], tl.where((j >= 0)[None, :], new, old),
             mask=(k < W)[None, :] & cm[:, None])


def conv_prefill(rows: ConvRows, x: torch.Tensor, conv: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """SiLU of the causal convolution of the prefill rows x ``[T, conv_dim]`` (any float dtype,
    unit stride on channels), each sequence continuing from its read block's window in conv
    ``[blocks, conv_dim, W]`` (float32, unit stride on W); weight ``[conv_dim, 1, W + 1]``. Writes
    the window at each save point into its block (after every read: a save may name the read
    block). Returns ``[T, conv_dim]`` in ``out_dtype`` (summed in float32)."""
    T, conv_dim = x.shape
    W = conv.shape[2]
    assert conv.stride(2) == 1 and x.stride(1) == 1 and weight.stride(2) == 1
    out = torch.empty(T, conv_dim, dtype=out_dtype, device=x.device)
    b = bias if bias is not None else weight
    _conv_prefill_kernel[(triton.cdiv(T, _CONV_ROWS), triton.cdiv(conv_dim, _CONV_CHANNELS))](
        x, conv, rows.seq_row, rows.read, weight, b, out, T, conv_dim, x.stride(0), conv.stride(0), conv.stride(1),
        weight.stride(0), out.stride(0), W=W, BT=_CONV_ROWS, BC=_CONV_CHANNELS, HAS_BIAS=bias is not None,
        num_warps=_CONV_WARPS)
    n = rows.saves.shape[1]
    if n:
        _conv_save_kernel[(n, triton.cdiv(conv_dim, 128))](
            x, conv, rows.saves, n, conv_dim, x.stride(0), conv.stride(0), conv.stride(1),
            W=W, WP=triton.next_power_of_2(W), BC=128, num_warps=4)
    return out
