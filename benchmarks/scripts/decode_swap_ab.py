"""Probe (H100): variants of the 8-bit paged decode kernel against the engine's kernel on the same
fp8 caches: the key tile as the dots' first operand ("swap AB": s^T = K q^T, out^T = V^T p^T, so
M is the 128-key tile rather than the padded query group of 16 and Triton uses wgmma), and fp8
tensor-core dots for q.K with the query quantized to fp8 per row, or split into fp8 high and low
parts. Shapes and pools: ``paged_kv_fixture.py``; random tables. Prints ms, speed-up over
bf16, the error against a float64 reference over the dequantized cache, and which MMA the PTX uses."""
import torch
import triton
import triton.language as tl
from paged_kv_fixture import BS, HD, KVH, NB, H, quantized_pool, random_pool, timed
from paged_kv_fixture import DEVICE as dev

from kvos.kernels import decode_attention as D
from kvos.kernels.kv_quant import dequantize
from kvos.kernels.tile_attention import LOG2E, V_FOLD


@triton.jit
def _probe_kernel(q_ptr, k_ptr, v_ptr, tab_ptr, lens_ptr, ks_ptr, vs_ptr, part_out_ptr, part_lse_ptr,
                  scale_log2, stride_kb, stride_ko, stride_kh, stride_ksb, stride_kso, stride_ksh,
                  stride_tb, num_heads, group,
                  NUM_SPLITS: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_G: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, SWAP: tl.constexpr, QK: tl.constexpr):
    """QK: 0 = K widened to fp16, q fp16; 1 = fp8 dot with q quantized to fp8 per row;
    2 = fp8 dots with q split into fp8 hi + lo parts (two dots)."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(lens_ptr + b).to(tl.int32)
    keys_per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = tl.minimum(split * keys_per_split, seq_len)
    end = tl.minimum(start + keys_per_split, seq_len)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kvh * group + offs_g
    gmask = offs_g < group
    q = tl.load(q_ptr + (b * num_heads + heads)[:, None] * BLOCK_D + offs_d[None, :],
                mask=gmask[:, None], other=0.0).to(tl.float32)
    q_amax = tl.maximum(tl.max(tl.abs(q), 1), 1e-30)
    q_scale = q_amax / 448.0
    q_hi = (q / q_scale[:, None]).to(tl.float8e4nv)
    res = q - q_hi.to(tl.float32) * q_scale[:, None]
    r_scale = tl.maximum(tl.max(tl.abs(res), 1), 1e-30) / 448.0
    q_lo = (res / r_scale[:, None]).to(tl.float8e4nv)
    if QK == 0:
        qd = q.to(tl.float16)
        sc = tl.full([BLOCK_G], 1.0, tl.float32) * scale_log2
    else:
        qd = q_hi
        sc = q_scale * scale_log2
        sc_lo = r_scale * scale_log2
    if SWAP:
        acc = tl.zeros([BLOCK_D, BLOCK_G], tl.float32)
    else:
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    k_head = k_ptr + kvh * stride_kh
    v_head = v_ptr + kvh * stride_kh
    ks_head = ks_ptr + kvh * stride_ksh
    vs_head = vs_ptr + kvh * stride_ksh
    for n in range(start, end, BLOCK_N):
        pos = n + offs_n
        block = tl.load(tab_ptr + b * stride_tb + pos // BLOCK_SIZE).to(tl.int64)
        row = block * stride_kb + (pos % BLOCK_SIZE) * stride_ko
        srow = block * stride_ksb + (pos % BLOCK_SIZE) * stride_kso
        k = tl.load(k_head + row[:, None] + offs_d[None, :])
        k_scale = tl.load(ks_head + srow)
        if QK == 0:
            kk = k.to(tl.float16)
        else:
            kk = k
        if SWAP:
            st = tl.dot(kk, tl.trans(qd)) * sc[None, :]
            if QK == 2:
                st += tl.dot(kk, tl.trans(q_lo)) * sc_lo[None, :]
            st = st * k_scale[:, None]
            m_new = tl.maximum(m_i, tl.max(st, 0))
            alpha = tl.exp2(m_i - m_new)
            pt = tl.exp2(st - m_new[None, :])
            l_i = l_i * alpha + tl.sum(pt, 0)
            v = tl.load(v_head + row[:, None] + offs_d[None, :])
            v_scale = tl.load(vs_head + srow)
            pw = (pt * (v_scale * V_FOLD)[:, None]).to(tl.float16)
            acc = tl.dot(tl.trans(v.to(tl.float16)), pw, acc * alpha[None, :])
        else:
            s = tl.dot(qd, tl.trans(kk)) * sc[:, None]
            if QK == 2:
                s += tl.dot(q_lo, tl.trans(kk)) * sc_lo[:, None]
            s = s * k_scale[None, :]
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_head + row[:, None] + offs_d[None, :])
            v_scale = tl.load(vs_head + srow)
            pw = (p * (v_scale * V_FOLD)[None, :]).to(tl.float16)
            acc = tl.dot(pw, v.to(tl.float16), acc * alpha[:, None])
        m_i = m_new
    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    rows = (b * num_heads + heads) * NUM_SPLITS + split
    if SWAP:
        o = acc / l_safe[None, :] * (1.0 / V_FOLD)  # [D, G]
        tl.store(part_out_ptr + rows[None, :] * BLOCK_D + offs_d[:, None], o, mask=gmask[None, :])
    else:
        o = acc / l_safe[:, None] * (1.0 / V_FOLD)
        tl.store(part_out_ptr + rows[:, None] * BLOCK_D + offs_d[None, :], o, mask=gmask[:, None])
    lse = tl.where(seen, m_i + tl.log2(l_safe), float("-inf"))
    tl.store(part_lse_ptr + rows, lse, mask=gmask)


def probe_decode(q, k, v, tables, lens, scale, ks, vs, swap, qk, block_n=128, warps=4, stages=3):
    batch = q.shape[0]
    splits = D.decode_num_splits(batch, KVH, tables.shape[1], BS)
    part_out = torch.empty(batch, H, splits, HD, dtype=torch.float32, device=dev)
    part_lse = torch.empty(batch, H, splits, dtype=torch.float32, device=dev)
    out = torch.empty_like(q)
    ck = _probe_kernel[(batch, KVH, splits)](
        q, k, v, tables, lens, ks, vs, part_out, part_lse, scale * LOG2E,
        k.stride(0), k.stride(1), k.stride(2), ks.stride(0), ks.stride(1), ks.stride(2),
        tables.stride(0), H, H // KVH,
        NUM_SPLITS=splits, BLOCK_SIZE=BS, BLOCK_G=16, BLOCK_N=block_n, BLOCK_D=HD, SWAP=swap, QK=qk,
        num_warps=warps, num_stages=stages)
    D._decode_combine_kernel[(batch, H)](part_out, part_lse, out, *out.stride(), H, NUM_SPLITS=splits,
                                         BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=HD, HEAD_DIM=HD,
                                         num_warps=4)
    return out, ck


def mma_kinds(ck) -> str:
    ptx = ck.asm["ptx"]
    return f"wgmma={ptx.count('wgmma.mma_async')} mma.sync={ptx.count('mma.sync')}"


def reference(q, k, v, ks, vs, tables, lens, scale, batch_rows=4):
    """float64 attention over the dequantized cache for the first batch_rows sequences."""
    outs = []
    for b in range(batch_rows):
        blocks = tables[b, : int(lens[b]) // BS].long()
        kk = dequantize(k[blocks], ks[blocks], torch.float64).double().reshape(-1, KVH, HD)
        vv = dequantize(v[blocks], vs[blocks], torch.float64).double().reshape(-1, KVH, HD)
        kk = kk.repeat_interleave(H // KVH, 1)
        vv = vv.repeat_interleave(H // KVH, 1)
        s = torch.einsum("hd,nhd->hn", q[b].double(), kk) * scale
        outs.append(torch.einsum("hn,nhd->hd", s.softmax(-1), vv))
    return torch.stack(outs)


kb, vb = random_pool()
kq, vq, ks, vs = quantized_pool(kb, vb, "fp8_e4m3")
for batch, ctx in ((64, 32768), (256, 8192), (64, 8192)):
    tables = torch.randint(1, NB, (batch, ctx // BS), dtype=torch.int32, device=dev)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    q = torch.randn(batch, H, HD, device=dev, dtype=torch.bfloat16)
    scale = HD ** -0.5
    bf = timed(lambda: D.paged_decode_attention(q, kb, vb, tables, lens, scale))
    ref = reference(q, kq, vq, ks, vs, tables, lens, scale)
    cur = D.paged_decode_attention(q, kq, vq, tables, lens, scale, k_scale=ks, v_scale=vs)
    t_cur = timed(lambda: D.paged_decode_attention(q, kq, vq, tables, lens, scale, k_scale=ks, v_scale=vs))
    err = (cur[:4].double() - ref).abs().max().item()
    print(f"b={batch} ctx={ctx}: bf16 {bf:.3f} ms; engine fp8 {t_cur:.3f} ms ({bf / t_cur:.2f}x) err {err:.2e}",
          flush=True)
    for swap, qk in ((False, 0), (False, 1), (True, 1), (True, 2)):
        for bn, w, st in ((128, 4, 3), (128, 4, 4)):
            tag = f"swap={int(swap)} qk={qk} N={bn} w={w} st={st}"
            try:
                out, ck = probe_decode(q, kq, vq, tables, lens, scale, ks, vs, swap, qk, bn, w, st)
                err = (out[:4].double() - ref).abs().max().item()
                t = timed(lambda: probe_decode(q, kq, vq, tables, lens, scale, ks, vs, swap, qk, bn, w, st))
                print(f"  {tag}: {t:.3f} ms ({bf / t:.2f}x bf16, {t_cur / t:.3f}x engine) err {err:.2e} "
                      f"{mma_kinds(ck)}", flush=True)
            except Exception as e:
                print(f"  {tag}: failed {type(e).__name__}: {str(e)[:300]}", flush=True)
    t_again = timed(lambda: D.paged_decode_attention(q, kq, vq, tables, lens, scale, k_scale=ks, v_scale=vs))
    print(f"  engine again: {t_again:.3f} ms", flush=True)
