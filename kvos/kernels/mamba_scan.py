"""The selective scan of a step's Mamba2 prefill rows in chunks (state-space duality), in three
Triton kernels over every prefill sequence of the step at once.

Each sequence's new tokens are cut into chunks of at most ``CHUNK`` tokens that end at its save
points (``SeqStates.saves``), so that the state after a chunk is the state a save asks for.
Per chunk and head, with ``cs`` the running sum of ``dt A`` inside the chunk:

1. ``_chunk_state_kernel``: the chunk's own contribution to the state, ``sum_s exp(cs_end -
   cs_s) dt_s x_s B_s^T`` ``[P, N]``, and its total decay ``cs_end``;
2. ``_state_pass_kernel``: per sequence, in chunk order, the state entering each chunk
   (``h_c = exp(cs_end_{c-1}) h_{c-1} + own_{c-1}``, from the read block's state or zeros),
   stored over the chunk's own contribution, and the states at save points written into their
   blocks;
3. ``_chunk_scan_kernel``: ``y_t = exp(cs_t) C_t h_c + sum_{s<=t} (C_t . B_s) exp(cs_t - cs_s)
   dt_s x_s + D x_t``.

Float32 throughout; the matrix products use TF32 unless ``exact`` (float32 models: the CPU
path's precision). Safety: the blocks named must be referenced for the whole step and no two
sequences may write the same block (``StateMetadata``'s rule); a sequence's read block may be
one of its save blocks (each program reads its tile of the state before writing it). No host
synchronisation beyond building the chunk table from host lists.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

CHUNK = 64
"""Tokens per chunk: the quadratic part's tile (``CHUNK x CHUNK`` per head)."""
_BLOCK_N = 64
_PASS_BLOCK = 1024


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
    """The chunk table of ``seqs`` (``SeqStates`` of prefills, rows counted from ``row0``):
    boundaries every ``chunk`` tokens of each sequence and at each of its save points."""
    start, length, save, first, count, read = [], [], [], [], [], []
    for q in seqs:
        saves = dict(q.saves)
        ends = sorted(set(range(chunk, q.num_tokens, chunk)) | set(saves))
        first.append(len(start))
        count.append(len(ends))
        read.append(q.read_block)
        lo = 0
        for hi in ends:
            start.append(q.row - row0 + lo)
            length.append(hi - lo)
            save.append(saves.get(hi, -1))
            lo = hi
    t = torch.tensor([start, length, save], dtype=torch.int32).to(device, non_blocking=True)
    s = torch.tensor([first, count, read], dtype=torch.int32).to(device, non_blocking=True)
    return ScanChunks(t[0], t[1], t[2], s[0], s[1], s[2])


@triton.jit
def _chunk_decay(dt_ptr, a_ptr, start, length, h, sdt, L: tl.constexpr):
    """(rows' mask, dt, running sum of dt A inside the chunk, its total) for chunk rows ``[start,
    start + length)`` and head h."""
    t = tl.arange(0, L)
    tm = t < length
    dt = tl.load(dt_ptr + (start + t).to(tl.int64) * sdt + h, mask=tm, other=0.0)
    da = dt * tl.load(a_ptr + h)
    cs = tl.cumsum(da, axis=0)
    return tm, dt, cs, tl.sum(da, axis=0)


@triton.jit
def _chunk_state_kernel(
    x_ptr, dt_ptr, a_ptr, b_ptr, start_ptr, len_ptr, st_ptr, decay_ptr,
    sx_t, sx_h, sdt, sb_t, sb_g, H, heads_per_group,
    P: tl.constexpr, N: tl.constexpr, L: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
    PRECISION: tl.constexpr,
):
    c = tl.program_id(0)
    h = tl.program_id(1)
    nb = tl.program_id(2)
    start = tl.load(start_ptr + c)
    length = tl.load(len_ptr + c)
    tm, dt, cs, total = _chunk_decay(dt_ptr, a_ptr, start, length, h, sdt, L)
    w = tl.where(tm, dt * tl.exp(total - cs), 0.0)
    rows = (start + tl.arange(0, L)).to(tl.int64)
    p = tl.arange(0, BP)
    n = nb * BN + tl.arange(0, BN)
    x = tl.load(x_ptr + rows[:, None] * sx_t + h * sx_h + p[None, :], mask=tm[:, None] & (p < P)[None, :], other=0.0)
    g = h // heads_per_group
    b = tl.load(b_ptr + rows[:, None] * sb_t + g * sb_g + n[None, :], mask=tm[:, None] & (n < N)[None, :], other=0.0)
    st = tl.dot(tl.trans(x * w[:, None]), b, input_precision=PRECISION)  # [BP, BN]
    out = st_ptr + (c.to(tl.int64) * H + h) * (P * N)
    tl.store(out + p[:, None] * N + n[None, :], st, mask=(p < P)[:, None] & (n < N)[None, :])
    if nb == 0:
        tl.store(decay_ptr + c * H + h, total)


@triton.jit
def _state_pass_kernel(
    st_ptr, decay_ptr, ssm_ptr, save_ptr, first_ptr, count_ptr, read_ptr,
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
        tl.store(at, state, mask=em)  # the chunk's own contribution becomes the state entering it
        state = tl.exp(tl.load(decay_ptr + c * H + h)) * state + own
        save = tl.load(save_ptr + c).to(tl.int64)
        tl.store(ssm_ptr + tl.maximum(save, 0) * s_blk + h * s_head + e, state, mask=em & (save >= 0))
        c += 1


@triton.jit
def _chunk_scan_kernel(
    x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, start_ptr, len_ptr, prev_ptr, y_ptr,
    sx_t, sx_h, sdt, sb_t, sb_g, sc_t, sc_g, sy_t, sy_h, H, heads_per_group,
    P: tl.constexpr, N: tl.constexpr, L: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
    PRECISION: tl.constexpr,
):
    c = tl.program_id(0)
    h = tl.program_id(1)
    start = tl.load(start_ptr + c)
    length = tl.load(len_ptr + c)
    tm, dt, cs, total = _chunk_decay(dt_ptr, a_ptr, start, length, h, sdt, L)
    rows = (start + tl.arange(0, L)).to(tl.int64)
    p = tl.arange(0, BP)
    pm = p < P
    g = h // heads_per_group
    prev = prev_ptr + (c.to(tl.int64) * H + h) * (P * N)
    cb = tl.zeros((L, L), dtype=tl.float32)
    acc = tl.zeros((L, BP), dtype=tl.float32)
    for k0 in range(0, N, BN):
        k = k0 + tl.arange(0, BN)
        km = k < N
        cm = tl.load(c_ptr + rows[:, None] * sc_t + g * sc_g + k[None, :], mask=tm[:, None] & km[None, :], other=0.0)
        bm = tl.load(b_ptr + rows[:, None] * sb_t + g * sb_g + k[None, :], mask=tm[:, None] & km[None, :], other=0.0)
        hm = tl.load(prev + p[:, None] * N + k[None, :], mask=pm[:, None] & km[None, :], other=0.0)
        cb = tl.dot(cm, tl.trans(bm), cb, input_precision=PRECISION)
        acc = tl.dot(cm, tl.trans(hm), acc, input_precision=PRECISION)
    acc = acc * tl.exp(cs)[:, None]
    t = tl.arange(0, L)
    causal = (t[:, None] >= t[None, :]) & tm[None, :]
    decay = tl.exp(tl.where(causal, cs[:, None] - cs[None, :], float("-inf")))
    x = tl.load(x_ptr + rows[:, None] * sx_t + h * sx_h + p[None, :], mask=tm[:, None] & pm[None, :], other=0.0)
    acc = tl.dot(cb * decay * dt[None, :], x, acc, input_precision=PRECISION)
    acc += tl.load(d_ptr + h) * x
    tl.store(y_ptr + rows[:, None] * sy_t + h * sy_h + p[None, :], acc, mask=tm[:, None] & pm[None, :])


def chunked_scan(chunks: ScanChunks, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                 C: torch.Tensor, D: torch.Tensor, ssm: torch.Tensor, y: torch.Tensor, exact: bool = False,
                 chunk: int = CHUNK) -> None:
    """The scan of ``chunks`` (built with the same ``chunk``): x ``[T, H, P]``, dt ``[T, H]``
    (after softplus), A/D ``[H]``, B and C ``[T, G, N]`` (heads share their group's), all float32
    with unit stride on the last dimension; ssm ``[blocks, H, P, N]`` (contiguous per head): read
    at each sequence's read block, written at its save blocks; y ``[T, H, P]`` written (without the
    gate)."""
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    assert ssm.stride(3) == 1 and ssm.stride(2) == N and x.stride(2) == 1 and B.stride(2) == 1 and C.stride(2) == 1
    assert y.stride(2) == 1 and dt.stride(1) == 1 and H % G == 0
    nc = chunks.num_chunks
    if nc == 0:
        return
    BP = max(16, triton.next_power_of_2(P))
    BN = min(_BLOCK_N, max(16, triton.next_power_of_2(N)))
    precision = "ieee" if exact else "tf32"
    st = torch.empty(nc, H, P, N, dtype=torch.float32, device=x.device)
    decay = torch.empty(nc, H, dtype=torch.float32, device=x.device)
    _chunk_state_kernel[(nc, H, triton.cdiv(N, BN))](
        x, dt, A, B, chunks.start, chunks.length, st, decay,
        x.stride(0), x.stride(1), dt.stride(0), B.stride(0), B.stride(1), H, H // G,
        P=P, N=N, L=chunk, BP=BP, BN=BN, PRECISION=precision, num_warps=4)
    _state_pass_kernel[(chunks.num_seqs, H, triton.cdiv(P * N, _PASS_BLOCK))](
        st, decay, ssm, chunks.save, chunks.seq_first, chunks.seq_count, chunks.seq_read,
        ssm.stride(0), ssm.stride(1), H, PN=P * N, BLOCK=_PASS_BLOCK, num_warps=4)
    _chunk_scan_kernel[(nc, H)](
        x, dt, A, B, C, D, chunks.start, chunks.length, st, y,
        x.stride(0), x.stride(1), dt.stride(0), B.stride(0), B.stride(1), C.stride(0), C.stride(1),
        y.stride(0), y.stride(1), H, H // G,
        P=P, N=N, L=chunk, BP=BP, BN=BN, PRECISION=precision, num_warps=4)
