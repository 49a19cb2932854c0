"""Scatter new K/V rows into the paged cache, quantizing them for a quantized cache."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvos.kernels import pdl
from kvos.kernels.kv_quant import FP8_SCALE_CANDIDATES, MIN_SCALE, QMAX, kv_dtype_of
from kvos.kernels.pdl import wait_for_previous

FP8_WRITE_WARPS = 1
"""Warps per program of the fp8 write: one warp holds a row, so the search's sums reduce within
the warp, and with the candidates in a loop (then not unrolled) a program needed about 50
registers, so many run per SM. H200, 8 kv heads x 128, one write inside a CUDA graph
(``benchmarks/scripts/write_kv_speed.py``): 256 rows 0.032 ms before (4 warps, the candidates as
one unrolled tile, ``div_rn``) -> 0.0125 ms (bf16 0.0025), 2,048 rows 0.225 -> 0.073 ms (bf16
0.011)."""

FP8_WRITE_SPLIT = True
"""The fp8 write runs K's and V's rows in programs of their own (a third grid axis): a decode
step's few rows are bound by the latency of the search (a chain of 16 candidates per row), not
its arithmetic, so twice the programs of half the chain take half the time."""

FP8_WRITE_UNROLL = 4
"""Candidates of the fp8 search per loop iteration: independent chains the compiler interleaves
(their sums reduce across the warp side by side); the order of comparison stays j = 0, 1, ...
With ``FP8_WRITE_SPLIT``, H200, 8 kv heads x 128, one write inside a CUDA graph
(``benchmarks/scripts/write_kv_speed.py``), ms: 64 rows 0.0083 -> 0.0047 (bf16 0.0011), 256 rows
0.0120 -> 0.0100, 2,048 rows 0.072 -> 0.065; a decode step of 64 sequences at 8K context on an
fp8 cache 14.41 -> 13.86-14.12 ms (``kvos bench kv-speed``, alternating runs)."""


@triton.jit
def _quantize_row(x, scale_ptr, mask_row, QMAX: tl.constexpr, MIN_SCALE: tl.constexpr,
                  ROUND: tl.constexpr):
    """Store the row's scale ``amax(|x|) / QMAX`` at ``scale_ptr`` (where ``mask_row``) and
    return ``clamp(x / max(scale, MIN_SCALE), -QMAX, QMAX)`` in fp32, rounded half to even when
    ROUND (int8), as ``kvos.kernels.kv_quant.quantize`` does. x: the row in fp32, zero where
    masked. Both divisions are correctly rounded (``div_rn``: Triton's ``/`` is approximate on
    CUDA), as torch's are on CPU, so scales and values match ``quantize`` there bit for bit."""
    scale = tl.div_rn(tl.max(tl.abs(x), 0), QMAX)
    tl.store(scale_ptr, scale, mask=mask_row)
    y = tl.div_rn(x, tl.maximum(scale, MIN_SCALE))
    y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
    if ROUND:
        # Round half to even (torch.round), exactly: |y| <= 127, so floor and y - floor are exact.
        r = tl.floor(y)
        frac = y - r
        odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
        y = r + tl.where((frac > 0.5) | ((frac == 0.5) & odd), 1.0, 0.0)
    return y


@triton.jit
def _round_e4m3(y):
    """``|y|`` (fp32, at most 448) rounded to the nearest float8 e4m3fn value, ties to even, as
    torch's cast does (subnormals kept): (that value in fp32, its e4m3fn code without the sign
    bit, int32). Exact fp32 arithmetic, so it is the same compiled and in Triton's interpreter
    (whose fp32 -> float8e4nv cast is wrong)."""
    a = tl.abs(y)
    # The binade's biased fp32 exponent, at least 121 (2**-6, e4m3's smallest normal): the step
    # between e4m3 values there is 2**(e - 130) (3 mantissa bits; 2**-9 for subnormals).
    e = tl.maximum(a.to(tl.int32, bitcast=True) >> 23, 121)
    step = ((e - 3) << 23).to(tl.float32, bitcast=True)
    t = a * ((257 - e) << 23).to(tl.float32, bitcast=True)  # a / step, exact: t < 16
    r = tl.floor(t)
    frac = t - r
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    r = r + tl.where((frac > 0.5) | ((frac == 0.5) & odd), 1.0, 0.0)
    # r in [8, 16] (normal; 16 carries into the next binade) or [0, 8] (subnormal): the code is
    # (biased e4m3 exponent) * 8 + mantissa = (e - 121) * 8 + r in both cases.
    return r * step, (e - 121) * 8 + r.to(tl.int32)


@triton.jit
def _quantize_row_fp8(x, scale_ptr, mask_row, MIN_SCALE: tl.constexpr, CANDIDATES: tl.constexpr,
                      HW_CVT: tl.constexpr, UNROLL: tl.constexpr = 1):
    """fp8 e4m3 as ``kvos.kernels.kv_quant.quantize``: of the scales ``(amax(|x|) / 448) * (1 + j /
    CANDIDATES)``, j < CANDIDATES, keep the one whose dequantized row has the least squared error
    (float64 sum; ties: the smallest j), store it at ``scale_ptr`` (where ``mask_row``) and return
    the row's e4m3fn bytes (int32, sign in bit 7) for a uint8 view of the cache. x: the row in
    fp32, zero where masked. The candidates are tried one after another, each a vector op over
    the row, keeping the best so far (UNROLL of them per iteration, compared in order; CANDIDATES
    a multiple of UNROLL). Divisions are correctly rounded as torch's are on CPU and
    the rounding to e4m3 is exact: HW_CVT (compiled) divides by the correctly rounded reciprocal
    with one FMA correction (Markstein's theorem: correctly rounded barring underflow of the
    residual, which needs a value below about 2**-100 in magnitude) and rounds by the GPU's
    round-to-nearest-even conversion (``cvt.rn.satfinite``); otherwise (Triton's interpreter,
    whose fp32 -> float8e4nv cast is wrong and whose fma rounds twice) ``div_rn`` and
    ``_round_e4m3``. So scales and bytes match ``quantize`` bit for bit; the
    error sums may differ from torch's in the last bits (another summation order), which can only
    matter where two candidates' errors tie to within float64 rounding."""
    base = tl.div_rn(tl.max(tl.abs(x), 0), 448.0)
    xd = x.to(tl.float64)
    best_err = tl.full((), float("inf"), tl.float64)
    best_s = base
    best_code = tl.zeros(x.shape, tl.int32)
    tl.static_assert(CANDIDATES % UNROLL == 0, "UNROLL must divide CANDIDATES")
    for j0 in range(0, CANDIDATES, UNROLL):  # a loop of UNROLL candidates: few registers, many programs per SM
        for jj in tl.static_range(UNROLL):
            j = j0 + jj
            s = base * (1.0 + j * (1.0 / CANDIDATES))  # exact: j / CANDIDATES is a power-of-two fraction
            divisor = tl.maximum(s, MIN_SCALE)
            if HW_CVT:
                # x / divisor correctly rounded from the correctly rounded reciprocal and one
                # correction (Markstein): three instructions per value instead of div_rn's ten
                r = tl.div_rn(1.0, divisor)
                q = x * r
                e = tl.fma(-q, divisor, x)
                y = tl.where(e == 0.0, q, tl.fma(e, r, q))  # q exact: keep its sign (-0.0)
            else:
                y = tl.div_rn(x, divisor)
            y = tl.minimum(tl.maximum(y, -448.0), 448.0)
            if HW_CVT:
                f8 = y.to(tl.float8e4nv, fp_downcast_rounding="rtne")
                val = f8.to(tl.float32)
                code = f8.to(tl.uint8, bitcast=True).to(tl.int32)
            else:
                val, code = _round_e4m3(y)
                negative = y.to(tl.int32, bitcast=True) < 0  # the sign bit: -0.0 too, as torch's cast
                val = tl.where(negative, -val, val)
                code = tl.where(negative, code + 128, code)
            d = val.to(tl.float64) * s.to(tl.float64) - xd
            err = tl.sum(d * d, 0)
            better = err < best_err  # strict: ties keep the smaller j
            best_err = tl.where(better, err, best_err)
            best_s = tl.where(better, s, best_s)
            best_code = tl.where(better, code, best_code)
    tl.store(scale_ptr, best_s, mask=mask_row)
    return best_code


@triton.jit
def _write_row_fp8(src, dst, scale_dst, mask, row_ok, MIN_SCALE: tl.constexpr, CANDIDATES: tl.constexpr,
                   HW_CVT: tl.constexpr, UNROLL: tl.constexpr):
    """Load one K or V row at ``src`` (``mask``), store its e4m3fn bytes at ``dst`` and its scale
    at ``scale_dst`` (where ``row_ok``): ``_quantize_row_fp8``."""
    x = tl.load(src, mask=mask, other=0.0)
    code = _quantize_row_fp8(x.to(tl.float32), scale_dst, row_ok, MIN_SCALE, CANDIDATES, HW_CVT, UNROLL)
    tl.store(dst, code.to(dst.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize_on_alignment=["slot_ptr", "k_scale_ptr", "v_scale_ptr"])
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kco, stride_kch, stride_kcd,
    stride_vcb, stride_vco, stride_vch, stride_vcd,
    stride_ksb, stride_kso, stride_ksh, stride_vsb, stride_vso, stride_vsh,
    head_dim,
    BLOCK_SIZE: tl.constexpr, BLOCK_D: tl.constexpr, QUANT: tl.constexpr,
    QMAX: tl.constexpr, MIN_SCALE: tl.constexpr, ROUND: tl.constexpr, FP8_CANDIDATES: tl.constexpr,
    HW_CVT: tl.constexpr = True, KV_PROGRAMS: tl.constexpr = 1, UNROLL: tl.constexpr = 1,
    PDL: tl.constexpr = False,
):
    """One program copies one token's K and V row of one kv head (fp8 with KV_PROGRAMS 2: K's row
    where ``program_id(2)`` is 0, V's where 1). QUANT: quantizes each row (``_quantize_row``; fp8
    when FP8_CANDIDATES > 0: ``_quantize_row_fp8``, into uint8 views of the caches) and stores its
    scale too; otherwise the scale arguments are never read. HW_CVT: the fp8 search's compiled
    arithmetic (False under Triton's interpreter; same bytes)."""
    tl.static_assert(KV_PROGRAMS == 1 or FP8_CANDIDATES > 0, "K and V apart is the fp8 write's")
    wait_for_previous(PDL)
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_d < head_dim) & (slot >= 0)
    k_src = k_ptr + t * stride_kt + h * stride_kh + offs_d * stride_kd
    v_src = v_ptr + t * stride_vt + h * stride_vh + offs_d * stride_vd
    k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kco + h * stride_kch + offs_d * stride_kcd
    v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vco + h * stride_vch + offs_d * stride_vcd
    if QUANT:
        k_scale_dst = k_scale_ptr + block * stride_ksb + offset * stride_kso + h * stride_ksh
        v_scale_dst = v_scale_ptr + block * stride_vsb + offset * stride_vso + h * stride_vsh
        if FP8_CANDIDATES > 0:
            # with KV_PROGRAMS 2, one row per program: the search's latency bounds a decode step
            which = tl.program_id(2)
            if which == 0:
                _write_row_fp8(k_src, k_dst, k_scale_dst, mask, slot >= 0, MIN_SCALE, FP8_CANDIDATES, HW_CVT, UNROLL)
            if which == KV_PROGRAMS - 1:
                _write_row_fp8(v_src, v_dst, v_scale_dst, mask, slot >= 0, MIN_SCALE, FP8_CANDIDATES, HW_CVT, UNROLL)
        else:
            k = _quantize_row(tl.load(k_src, mask=mask, other=0.0).to(tl.float32), k_scale_dst, slot >= 0, QMAX,
                              MIN_SCALE, ROUND)
            v = _quantize_row(tl.load(v_src, mask=mask, other=0.0).to(tl.float32), v_scale_dst, slot >= 0, QMAX,
                              MIN_SCALE, ROUND)
            tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
            tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(k_dst, tl.load(k_src, mask=mask).to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_dst, tl.load(v_src, mask=mask).to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """Write token t's K/V into flat cache slot ``slot_mapping[t]``, cast to the cache dtype
    (quantized, with its scales, for a quantized cache: see k_scale).

    k, v: ``[T, KVH, D]``, any strides. k_cache, v_cache: ``[num_blocks, block_size, KVH, D]``,
    any strides (each is addressed through its own). slot_mapping: ``[T]`` int32 or int64, slot =
    ``block_id * block_size + offset``; a negative slot skips its row (padding rows of a CUDA
    graph). Slots must be distinct (two rows writing one slot race). No host synchronisation, so
    it is safe inside a CUDA graph capture.

    k_scale, v_scale: a quantized cache (``kvos.kernels.kv_quant``), both or neither: float32
    ``[num_blocks, block_size, KVH]``, any strides, and k_cache, v_cache both float8_e4m3fn or
    both int8. Each (token, kv head) row of K and of V is then quantized as
    ``kv_quant.quantize`` does (symmetric, one scale per row, values ``clamp(row / max(scale,
    MIN_SCALE), -QMAX, QMAX)``; int8: ``scale = amax(|row|) / 127``, values rounded half to even;
    fp8: the least-squared-error scale of ``(amax(|row|) / 448) * (1 + j / 16)``, j < 16, values
    rounded to nearest even, same scales and bytes) and its scale stored at the row's
    ``[block, offset, head]``. A skipped
    row writes no scale either. Without scales the kernel compiles as before (a QUANT=False
    constexpr).
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    assert v.shape == k.shape and slot_mapping.shape == (num_tokens,)
    assert k_cache.shape[2:] == (num_kv_heads, head_dim) and v_cache.shape == k_cache.shape
    assert (k_scale is None) == (v_scale is None), "pass both k_scale and v_scale, or neither"
    if k_scale is None:
        kv_dtype = None
        scale_args = (k_cache, k_cache) + (0,) * 6  # never read
    else:
        kv_dtype = kv_dtype_of(k_cache.dtype)
        assert kv_dtype is not None and v_cache.dtype == k_cache.dtype, \
            "scaled caches must both be float8_e4m3fn or both int8"
        for s in (k_scale, v_scale):
            assert s.dtype == torch.float32 and s.shape == k_cache.shape[:3], \
                "scales: float32 [blocks, block_size, KVH]"
        scale_args = (k_scale, v_scale, *k_scale.stride(), *v_scale.stride())
    if num_tokens == 0:
        return
    fp8 = kv_dtype == "fp8_e4m3"
    if fp8:  # the kernel encodes e4m3 bytes itself (exact under the interpreter too)
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    kv_programs = 2 if fp8 and FP8_WRITE_SPLIT else 1
    _write_kv_kernel[(num_tokens, num_kv_heads, kv_programs)](
        k, v, k_cache, v_cache, slot_mapping, *scale_args[:2],
        *k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride(), *scale_args[2:],
        head_dim,
        BLOCK_SIZE=k_cache.shape[1], BLOCK_D=triton.next_power_of_2(head_dim),
        QUANT=kv_dtype is not None, QMAX=QMAX[kv_dtype] if kv_dtype else 0.0,
        MIN_SCALE=MIN_SCALE, ROUND=kv_dtype == "int8", FP8_CANDIDATES=FP8_SCALE_CANDIDATES if fp8 else 0,
        HW_CVT=not triton.knobs.runtime.interpret, KV_PROGRAMS=kv_programs, UNROLL=FP8_WRITE_UNROLL if fp8 else 1,
        num_warps=FP8_WRITE_WARPS if fp8 else 4, **pdl.launch_args(k),
    )
