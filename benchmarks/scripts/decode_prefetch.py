"""Probe (H100): the 8-bit paged decode kernel with software prefetch against the engine's kernel.

The engine's kernel waits for each tile's K/V loads at the top of its iteration, so only the
programs resident on an SM hide memory latency. Here each iteration issues the next tile's K/V
loads (and the table entries of the tile after that) before it computes the current tile, so the
loads are in flight during the dots and the softmax; the table entries run two tiles ahead
because the K/V addresses depend on them. Full tiles only (contexts a multiple of
``BLOCK_N * splits``); the last prefetch re-reads the range's last row. Shapes and pools:
``paged_kv_fixture.py``; random tables. Prints ms, speed-up over bf16 and the error against the
engine's fp8 output."""
import sys

import torch
import triton
import triton.language as tl
from paged_kv_fixture import BS, HD, KVH, NB, H, quantized_pool, random_pool, timed
from paged_kv_fixture import DEVICE as dev

from kvos.kernels import decode_attention as D
from kvos.kernels.tile_attention import LOG2E, V_FOLD, int8_to_fp16


@triton.jit
def _prefetch_kernel(q_ptr, k_ptr, v_ptr, tab_ptr, lens_ptr, ks_ptr, vs_ptr, part_out_ptr, part_lse_ptr,
                     scale_log2, stride_kb, stride_ko, stride_kh, stride_ksb, stride_kso, stride_ksh,
                     stride_tb, num_heads, group,
                     NUM_SPLITS: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_G: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PREFETCH: tl.constexpr,
                     INT8: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(lens_ptr + b).to(tl.int32)
    keys_per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = tl.minimum(split * keys_per_split, seq_len)
    end = tl.minimum(start + keys_per_split, seq_len)
    last = end - 1
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kvh * group + offs_g
    gmask = offs_g < group
    q = tl.load(q_ptr + (b * num_heads + heads)[:, None] * BLOCK_D + offs_d[None, :],
                mask=gmask[:, None], other=0.0)
    q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    k_head = k_ptr + kvh * stride_kh
    v_head = v_ptr + kvh * stride_kh
    ks_head = ks_ptr + kvh * stride_ksh
    vs_head = vs_ptr + kvh * stride_ksh
    tab = tab_ptr + b * stride_tb
    if PREFETCH:
        pos0 = tl.minimum(start + offs_n, last)
        blk0 = tl.load(tab + pos0 // BLOCK_SIZE).to(tl.int64)
        row0 = blk0 * stride_kb + (pos0 % BLOCK_SIZE) * stride_ko
        srow0 = blk0 * stride_ksb + (pos0 % BLOCK_SIZE) * stride_kso
        k_nx = tl.load(k_head + row0[:, None] + offs_d[None, :])
        ks_nx = tl.load(ks_head + srow0)
        v_nx = tl.load(v_head + row0[:, None] + offs_d[None, :])
        vs_nx = tl.load(vs_head + srow0)
        blk_nx = tl.load(tab + tl.minimum(start + BLOCK_N + offs_n, last) // BLOCK_SIZE)
    for n in range(start, end, BLOCK_N):
        if PREFETCH:
            k = k_nx
            k_scale = ks_nx
            v = v_nx
            v_scale = vs_nx
            pos1 = tl.minimum(n + BLOCK_N + offs_n, last)
            blk1 = blk_nx.to(tl.int64)
            row1 = blk1 * stride_kb + (pos1 % BLOCK_SIZE) * stride_ko
            srow1 = blk1 * stride_ksb + (pos1 % BLOCK_SIZE) * stride_kso
            k_nx = tl.load(k_head + row1[:, None] + offs_d[None, :])
            ks_nx = tl.load(ks_head + srow1)
            v_nx = tl.load(v_head + row1[:, None] + offs_d[None, :])
            vs_nx = tl.load(vs_head + srow1)
            blk_nx = tl.load(tab + tl.minimum(n + 2 * BLOCK_N + offs_n, last) // BLOCK_SIZE)
        else:
            pos = n + offs_n
            block = tl.load(tab + pos // BLOCK_SIZE).to(tl.int64)
            row = block * stride_kb + (pos % BLOCK_SIZE) * stride_ko
            srow = block * stride_ksb + (pos % BLOCK_SIZE) * stride_kso
            k = tl.load(k_head + row[:, None] + offs_d[None, :])
            k_scale = tl.load(ks_head + srow)
            v = tl.load(v_head + row[:, None] + offs_d[None, :])
            v_scale = tl.load(vs_head + srow)
        if INT8:
            kw = int8_to_fp16(k)
            vw = int8_to_fp16(v)
        else:
            kw = k.to(tl.float16)
            vw = v.to(tl.float16)
        s = tl.dot(q, tl.trans(kw))
        s = s * (k_scale * scale_log2)[None, :]
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        pw = (p * (v_scale * V_FOLD)[None, :]).to(tl.float16)
        acc = tl.dot(pw, vw, acc * alpha[:, None])
        m_i = m_new
    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    rows = (b * num_heads + heads) * NUM_SPLITS + split
    o = acc / l_safe[:, None] * (1.0 / V_FOLD)
    tl.store(part_out_ptr + rows[:, None] * BLOCK_D + offs_d[None, :], o, mask=gmask[:, None])
    lse = tl.where(seen, m_i + tl.log2(l_safe), float("-inf"))
    tl.store(part_lse_ptr + rows, lse, mask=gmask)


def probe_decode(q, k, v, tables, lens, scale, ks, vs, prefetch, block_n, cap, per_sm, stages=1):
    batch = q.shape[0]
    splits = max(2, D.decode_num_splits(batch, KVH, tables.shape[1], BS, programs_per_sm=per_sm))
    part_out = torch.empty(batch, H, splits, HD, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(batch, H, splits, dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    launch = {"maxnreg": cap} if cap else {}
    ck = _prefetch_kernel[(batch, KVH, splits)](
        q, k, v, tables, lens, ks, vs, part_out, part_lse, scale * LOG2E,
        k.stride(0), k.stride(1), k.stride(2), ks.stride(0), ks.stride(1), ks.stride(2),
        tables.stride(0), H, H // KVH,
        NUM_SPLITS=splits, BLOCK_SIZE=BS, BLOCK_G=16, BLOCK_N=block_n, BLOCK_D=HD, PREFETCH=prefetch, INT8=k.dtype == torch.int8,
        num_warps=4, num_stages=stages, **launch)
    D._decode_combine_kernel[(batch, H)](part_out, part_lse, out, *out.stride(), H, NUM_SPLITS=splits,
                                         BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=HD, HEAD_DIM=HD,
                                         num_warps=4)
    return out, ck


VARIANTS = [(1, 64, None, 4), (1, 64, None, 8), (1, 64, 168, 8), (0, 128, 168, 8), (0, 64, None, 4)]
"""(prefetch, keys per tile, register cap, programs per SM for the split count)"""

if __name__ == "__main__":
    kb, vb = random_pool()
    kv_dtype = sys.argv[1] if len(sys.argv) > 1 else "fp8_e4m3"
    kq, vq, ks, vs = quantized_pool(kb, vb, kv_dtype)
    for batch, ctx in ((64, 32768), (256, 32768), (64, 8192), (256, 8192)):
        tables = torch.randint(1, NB, (batch, ctx // BS), dtype=torch.int32, device=dev)
        lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
        q = torch.randn(batch, H, HD, device=dev, dtype=torch.bfloat16)
        scale = HD ** -0.5
        bf = timed(lambda: D.paged_decode_attention(q, kb, vb, tables, lens, scale))
        cur = D.paged_decode_attention(q, kq, vq, tables, lens, scale, k_scale=ks, v_scale=vs)
        t_cur = timed(lambda: D.paged_decode_attention(q, kq, vq, tables, lens, scale, k_scale=ks, v_scale=vs))
        print(f"b={batch} ctx={ctx}: bf16 {bf:.3f} ms; engine {kv_dtype} {t_cur:.3f} ms ({bf / t_cur:.2f}x)",
              flush=True)
        for pf, bn, cap, per_sm in VARIANTS:
            tag = f"prefetch={pf} N={bn} cap={cap} per_sm={per_sm}"
            try:
                out, ck = probe_decode(q, kq, vq, tables, lens, scale, ks, vs, pf, bn, cap, per_sm)
                err = (out.float() - cur.float()).abs().max().item()
                t = timed(lambda: probe_decode(q, kq, vq, tables, lens, scale, ks, vs, pf, bn, cap, per_sm))
                print(f"  {tag}: {t:.3f} ms ({bf / t:.2f}x bf16, {t_cur / t:.3f}x engine) err {err:.1e} "
                      f"regs {ck.n_regs} spills {ck.n_spills}", flush=True)
            except Exception as e:
                print(f"  {tag}: failed {type(e).__name__}: {str(e)[:300]}", flush=True)
