"""Quantized KV caches (fp8 e4m3, int8: ``kvos.kernels.kv_quant``) in the Triton kernels.

``write_kv`` with scales against ``kv_quant.quantize``; the attention kernels on quantized caches
against the same kernels on the dequantized caches (``kv_quant.dequantize``, same values, so the
results agree to fp32 rounding for fp32 queries) and against a float64 torch reference over the
dequantized keys and values.

On CUDA everything runs compiled. Without a GPU the kernels run in Triton's interpreter on CPU
tensors with small shapes, as in ``test_kernels.py``. The interpreter's fp32 -> float8e4nv cast is
wrong (its carry out of the mantissa does not reach an odd exponent, it flushes subnormals and
rounds ties up, Triton 3.6), but ``write_kv`` never uses it: it rounds to e4m3 and encodes the
bytes itself in exact fp32 arithmetic (for its scale search too), so its fp8 scales and bytes are
checked equal to ``kv_quant.quantize``'s on CPU as on CUDA. The interpreter's fp8 -> fp32 / fp16
cast is exact, so the fp8 attention tests run on CPU too.
"""
from __future__ import annotations

import pytest
import torch

from tests.support.triton_interpreter import (  # first: before triton loads
    CUDA,
    skip_unless_interpreted,
)

triton = pytest.importorskip("triton")

from kvos.kernels import cache_write, kv_quant  # noqa: E402
from kvos.kernels import decode_attention as _decode  # noqa: E402
from kvos.kernels.cache_write import write_kv  # noqa: E402
from kvos.kernels.prefill_attention import paged_prefill_attention  # noqa: E402

pytestmark = pytest.mark.gpu

paged_decode_attention = _decode.paged_decode_attention

skip_unless_interpreted(_decode._decode_split_kernel)

DEVICE = torch.device("cuda" if CUDA else "cpu")
KV_DTYPES = ["int8", "fp8_e4m3"]
# Query dtypes beyond fp32 (the interpreter's dot cannot multiply bf16).
LOW_DTYPES = [torch.bfloat16, torch.float16] if CUDA else [torch.float16]
NUM_KV_HEADS = 2
cuda_only = pytest.mark.skipif(not CUDA, reason="big shapes: CUDA only")


def write_params() -> list:
    """kv dtype x input dtype x block size x slot dtype."""
    params = []
    for kv_dtype in KV_DTYPES:
        for x_dtype in [torch.float32, *LOW_DTYPES]:
            for block_size, slot_dtype in ((16, torch.int32), (1, torch.int64)):
                if not CUDA and x_dtype != torch.float32 and block_size == 1:
                    continue  # the interpreter's run: half-precision inputs once per kv dtype
                name = f"{kv_dtype}-{str(x_dtype)[6:]}-bs{block_size}-{str(slot_dtype)[6:]}"
                params.append(pytest.param(kv_dtype, x_dtype, block_size, slot_dtype, id=name))
    return params


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any(), "output elements left unwritten (NaN poison) or NaN"
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def random_rows(gen: torch.Generator, *shape: int) -> torch.Tensor:
    """Normal rows times a per-row factor spanning ~e^-2 .. e^2, so rows' scales differ (a kernel
    applying the wrong row's scale fails), and a few all-zero rows (scale 0)."""
    x = torch.randn(*shape, generator=gen) * torch.exp(torch.randn(*shape[:-1], 1, generator=gen))
    flat = x.view(-1, shape[-1])
    flat[torch.randperm(flat.shape[0], generator=gen)[: max(1, flat.shape[0] // 50)]] = 0.0
    return x


# ---------------------------------------------------------------------------------------- write_kv


@pytest.mark.parametrize("kv_dtype,x_dtype,block_size,slot_dtype", write_params())
def test_write_kv_quantizes_like_torch(kv_dtype, x_dtype, block_size, slot_dtype):
    """Scales equal kv_quant.quantize's; int8 values equal (up to 1 at exact .5 ties); fp8 (the
    write-time scale search) scales and bytes exactly equal, rows whose candidates tie included,
    and values within the format's error bound. Caches and scales are strided views of page-major pools
    ``[blocks, layers, 2, block_size, KVH(, D)]``; padding slots (-1) and every other slot keep
    their old bytes and scales."""
    gen = torch.Generator().manual_seed(block_size)
    head_dim, tokens = 80, 13
    num_blocks = 1 + -(-2 * tokens // block_size)
    storage = kv_quant.TORCH_DTYPES[kv_dtype]
    pool, pool_scales = kv_quant.quantize(
        random_rows(gen, num_blocks, 3, 2, block_size, NUM_KV_HEADS, head_dim), kv_dtype)
    pool, pool_scales = pool.to(DEVICE), pool_scales.to(DEVICE)
    before, before_scales = pool.clone(), pool_scales.clone()
    # k and v as strided views of one tensor, as split off a fused projection.
    kv_new = random_rows(gen, tokens, 2 * NUM_KV_HEADS, head_dim)
    kv_new[0, 0] = kv_new[0, 0].clamp(-100.0, 100.0)
    kv_new[0, 0, :4] = torch.tensor([127.0, 2.5, -3.5, 0.5])  # int8 scale 1: exact .5 ties
    kv_new[2, 1] = 0.0  # fp8: candidates m = 1 and 7/4 both exact, a tie (the first wins)
    kv_new[2, 1, :3] = torch.tensor([56.0, -28.0, 14.0])
    kv_new[3, 2, :3] = torch.tensor([3e-5, -2e-5, -0.0])  # fp8 subnormals and a negative zero
    kv_new = kv_new.to(DEVICE, x_dtype)
    k, v = kv_new[:, :NUM_KV_HEADS], kv_new[:, NUM_KV_HEADS:]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[1::4] = -1  # padding rows: skipped
    write_kv(k, v, pool[:, 1, 0], pool[:, 1, 1], slots.to(DEVICE, slot_dtype),
             k_scale=pool_scales[:, 1, 0], v_scale=pool_scales[:, 1, 1])

    kept = (slots >= 0).to(DEVICE)
    blocks, offsets = (slots[slots >= 0] // block_size).to(DEVICE), (slots[slots >= 0] % block_size).to(DEVICE)
    untouched = torch.ones(pool_scales.shape, dtype=torch.bool, device=DEVICE)
    for i, x in ((0, k), (1, v)):
        x = x[kept]
        # The reference on CPU: CUDA torch divides by a scalar as a multiply by its reciprocal.
        want_q, want_scale = kv_quant.quantize(x.cpu(), kv_dtype)
        got_q, got_scale = pool[blocks, 1, i, offsets].cpu(), pool_scales[blocks, 1, i, offsets].cpu()
        torch.testing.assert_close(got_scale, want_scale, rtol=1e-6, atol=0)
        if kv_dtype == "int8":
            y = x.cpu().float() / want_scale.clamp_min(kv_quant.MIN_SCALE).unsqueeze(-1)
            ties = ((y - y.floor()) - 0.5).abs() <= 1e-4  # .5 ties, up to a scale 1 ulp off
            diff = got_q.int() - want_q.int()
            assert ((diff == 0) | (ties & (diff.abs() == 1))).all()
        else:
            assert torch.equal(got_scale, want_scale)
            assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8))
            xd = x.cpu().double()
            err = (kv_quant.dequantize(got_q, got_scale, torch.float64) - xd).abs()
            bound = torch.maximum(xd.abs() * 2.0 ** -4, got_scale.double().unsqueeze(-1) * 2.0 ** -10)
            assert (err <= bound * (1 + 1e-6) + 1e-30).all()
        untouched[blocks, 1, i, offsets] = False
    assert pool.dtype == storage
    assert torch.equal(pool[untouched].view(torch.uint8), before[untouched].view(torch.uint8))
    assert torch.equal(pool_scales[untouched], before_scales[untouched])


@pytest.mark.parametrize("split,unroll", [(False, 1), (True, 2)])
def test_fp8_write_launch_variants_write_the_same_bytes(monkeypatch, split, unroll):
    """The fp8 write with K and V in one program and the candidates one per iteration (the
    launch before ``FP8_WRITE_SPLIT`` and ``FP8_WRITE_UNROLL``), and another unroll: the same
    checks as the default launch."""
    monkeypatch.setattr(cache_write, "FP8_WRITE_SPLIT", split)
    monkeypatch.setattr(cache_write, "FP8_WRITE_UNROLL", unroll)
    test_write_kv_quantizes_like_torch("fp8_e4m3", torch.float32, 16, torch.int32)


def test_write_kv_checks_scale_arguments():
    k = torch.randn(2, NUM_KV_HEADS, 64, device=DEVICE)
    cache = torch.zeros(2, 16, NUM_KV_HEADS, 64, dtype=torch.int8, device=DEVICE)
    scales = torch.zeros(2, 16, NUM_KV_HEADS, device=DEVICE)
    slots = torch.tensor([0, 1], device=DEVICE)
    with pytest.raises(AssertionError):  # one scale without the other
        write_kv(k, k, cache, cache.clone(), slots, k_scale=scales)
    with pytest.raises(AssertionError):  # scales for an unquantized cache
        write_kv(k, k, cache.float(), cache.float(), slots, k_scale=scales, v_scale=scales)
    with pytest.raises(AssertionError):  # scales of the wrong shape
        write_kv(k, k, cache, cache.clone(), slots, k_scale=scales[:, :8], v_scale=scales[:, :8])


# ------------------------------------------------------------------------------ paged attention


class QuantPaged:
    """Quantized caches with random contents and random (permuted) block tables, as
    ``test_kernels.Paged``: K and V (and their scales) are ``[:, layer 1, 0]`` and ``[:, layer 1,
    1]`` of page-major pools ``[blocks, 3, 2, block_size, KVH(, D)]`` (strided views), or
    ``[layer 1, 0]`` / ``[layer 1, 1]`` of ``[2, 2, blocks, ...]`` pools. Every slot holds random
    data, so reading the wrong key or scale changes the result. ``token_minor``: V (not its
    scales) moved to the engine's 8-bit layout, each block's rows of one head ``[D, block_size]``
    (``v_cache.stride(1) == 1``), same values."""

    def __init__(self, seq_lens: list[int], block_size: int, head_dim: int, kv_dtype: str,
                 gen: torch.Generator, page_major: bool = True, token_minor: bool = False):
        self.seq_lens, self.block_size = seq_lens, block_size
        counts = [-(-n // block_size) for n in seq_lens]
        num_blocks = 1 + sum(counts) + 3
        if page_major:
            x = random_rows(gen, num_blocks, 3, 2, block_size, NUM_KV_HEADS, head_dim)
            values, scales = kv_quant.quantize(x, kv_dtype)
            values, scales = values.to(DEVICE), scales.to(DEVICE)
            self.k_cache, self.v_cache = values[:, 1, 0], values[:, 1, 1]
            self.k_scale, self.v_scale = scales[:, 1, 0], scales[:, 1, 1]
        else:
            x = random_rows(gen, 2, 2, num_blocks, block_size, NUM_KV_HEADS, head_dim)
            values, scales = kv_quant.quantize(x, kv_dtype)
            values, scales = values.to(DEVICE), scales.to(DEVICE)
            self.k_cache, self.v_cache = values[1, 0], values[1, 1]
            self.k_scale, self.v_scale = scales[1, 0], scales[1, 1]
        if token_minor:
            self.v_cache = self.v_cache.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
            assert self.v_cache.stride(1) == 1
        ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
        self.block_tables = torch.zeros(len(seq_lens), max(counts) + 2, dtype=torch.int32)
        for i, n in enumerate(counts):
            self.block_tables[i, :n] = torch.tensor(ids[:n], dtype=torch.int32)
            ids = ids[n:]
        self.block_tables = self.block_tables.to(DEVICE)
        self.full_tables = self.block_tables.clone()
        self.seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)

    @property
    def scales(self) -> dict:
        return {"k_scale": self.k_scale, "v_scale": self.v_scale}

    def dequantized(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Both caches dequantized, ``[num_blocks, block_size, KVH, D]`` in dtype (contiguous)."""
        return (kv_quant.dequantize(self.k_cache, self.k_scale, dtype),
                kv_quant.dequantize(self.v_cache, self.v_scale, dtype))

    def drop_blocks_before(self, first_keys: list[int]) -> None:
        """Point blocks wholly before key ``first_keys[s]`` at the null block 0 and poison it: NaN
        scales (and NaN fp8 values), so a kernel reading any of it returns NaN."""
        for s, first in enumerate(first_keys):
            self.block_tables[s, : max(0, first) // self.block_size] = 0
        self.k_scale[0] = float("nan")
        self.v_scale[0] = float("nan")
        if self.k_cache.dtype == torch.float8_e4m3fn:
            self.k_cache[0].view(torch.uint8).fill_(0x7F)
            self.v_cache[0].view(torch.uint8).fill_(0x7F)

    def poison_unused_rows(self, first_keys: list[int] | None = None) -> None:
        """Rows a kernel may read but must not use (``load_value_pages``): NaN scales (and fp8
        NaN values) in every row past a sequence's length in its last block and, with
        ``first_keys``, before key ``first_keys[s]`` in the block holding it."""
        bs = self.block_size
        for s, n in enumerate(self.seq_lens):
            rows = [(n // bs, slice(n % bs, None))] if n % bs else []
            if first_keys and first_keys[s] > 0:
                rows.append((first_keys[s] // bs, slice(0, first_keys[s] % bs)))
            for index, offsets in rows:
                block = int(self.full_tables[s, index])
                for data, scales in ((self.k_cache, self.k_scale), (self.v_cache, self.v_scale)):
                    scales[block, offsets] = float("nan")
                    if data.dtype == torch.float8_e4m3fn:
                        data[block, offsets].view(torch.uint8).fill_(0x7F)

    def context(self, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence ``seq``'s dequantized keys and values in position order, float64."""
        pos = torch.arange(self.seq_lens[seq], device=DEVICE)
        blocks = self.full_tables[seq, pos // self.block_size].long()
        offsets = pos % self.block_size
        return (kv_quant.dequantize(self.k_cache[blocks, offsets], self.k_scale[blocks, offsets],
                                    torch.float64),
                kv_quant.dequantize(self.v_cache[blocks, offsets], self.v_scale[blocks, offsets],
                                    torch.float64))


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, q_pos: torch.Tensor,
              scale: float, window: int | None = None) -> torch.Tensor:
    """float64 attention of q ``[n, H, D]`` at positions q_pos over keys/values ``[L, KVH, D]``
    (causal, optionally windowed; query head h reads kv head ``h // (H // KVH)``)."""
    group = q.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(group, dim=1)
    v = values.repeat_interleave(group, dim=1)
    key_pos = torch.arange(keys.shape[0], device=q.device)
    s = torch.einsum("nhd,lhd->hnl", q.double(), k) * scale
    hidden = key_pos[None, :] > q_pos[:, None]
    if window:
        hidden |= key_pos[None, :] <= q_pos[:, None] - window
    s = s.masked_fill(hidden[None], float("-inf"))
    v = v.masked_fill(hidden.all(0)[:, None, None], 0.0)  # keys no query sees may hold NaN
    return torch.einsum("hnl,lhd->nhd", s.softmax(-1), v)


def run_decode(lens, group, head_dim, kv_dtype, q_dtype, seed, num_splits=None, window=None,
               page_major=True, token_minor=False, block_size=16):
    """(quantized kernel, same kernel on the dequantized caches, float64 reference)."""
    gen = torch.Generator().manual_seed(seed)
    paged = QuantPaged(lens, block_size, head_dim, kv_dtype, gen, page_major=page_major,
                       token_minor=token_minor)
    if token_minor:
        paged.poison_unused_rows([n - window for n in lens] if window else None)
    if window:
        paged.drop_blocks_before([n - window for n in lens])
    q = torch.randn(len(lens), NUM_KV_HEADS * group, head_dim, generator=gen).to(DEVICE, q_dtype)
    scale = head_dim ** -0.5
    out = torch.full_like(q, float("nan"))
    res = paged_decode_attention(q, paged.k_cache, paged.v_cache, paged.block_tables,
                                 paged.seq_lens_t, scale, out=out, num_splits=num_splits,
                                 window=window, **paged.scales)
    assert res is out
    k_deq, v_deq = paged.dequantized(q_dtype)
    plain = paged_decode_attention(q, k_deq, v_deq, paged.block_tables, paged.seq_lens_t, scale,
                                   num_splits=num_splits, window=window)
    refs = []
    for b, n in enumerate(lens):
        keys, values = paged.context(b)
        refs.append(reference(q[b : b + 1], keys, values, torch.tensor([n - 1], device=DEVICE),
                              scale, window))
    return out, plain, torch.cat(refs)


def run_prefill(seqs, group, head_dim, kv_dtype, q_dtype, seed, window=None, page_major=True,
                token_minor=False, dequantize=False):
    """seqs: (query length, total length) per sequence. Returns as ``run_decode``. dequantize:
    the quantized call takes the dequantized-scratch path (``max_seq_len``, no query-length
    threshold), with NaN scales and values in the block that pads every table (block 0)."""
    gen = torch.Generator().manual_seed(seed)
    paged = QuantPaged([n for _, n in seqs], 16, head_dim, kv_dtype, gen, page_major=page_major,
                       token_minor=token_minor)
    if token_minor:
        paged.poison_unused_rows([n - q_len - window + 1 for q_len, n in seqs] if window else None)
    if window:
        paged.drop_blocks_before([n - q_len - window + 1 for q_len, n in seqs])
    num_heads = NUM_KV_HEADS * group
    total = sum(q_len for q_len, _ in seqs)
    qkv = torch.randn(total, num_heads + 2 * NUM_KV_HEADS, head_dim, generator=gen).to(DEVICE, q_dtype)
    q = qkv[:, :num_heads]  # a strided view, as split off a fused QKV projection
    extra = {}
    if dequantize:
        paged.drop_blocks_before([0] * len(seqs))  # poisons block 0, the tables' padding
        extra = {"max_seq_len": max(n for _, n in seqs), "dequantize_min_query": 1}
    starts = [0]
    for q_len, _ in seqs:
        starts.append(starts[-1] + q_len)
    query_start_loc = torch.tensor(starts, dtype=torch.int32, device=DEVICE)
    max_q = max(q_len for q_len, _ in seqs)
    scale = head_dim ** -0.5
    out = torch.full_like(q, float("nan"))
    res = paged_prefill_attention(q, paged.k_cache, paged.v_cache, paged.block_tables,
                                  query_start_loc, paged.seq_lens_t, max_q, scale, out=out,
                                  window=window, **paged.scales, **extra)
    assert res is out
    k_deq, v_deq = paged.dequantized(q_dtype)
    plain = paged_prefill_attention(q, k_deq, v_deq, paged.block_tables, query_start_loc,
                                    paged.seq_lens_t, max_q, scale, window=window)
    refs = []
    for s, (q_len, n) in enumerate(seqs):
        keys, values = paged.context(s)
        pos = torch.arange(n - q_len, n, device=DEVICE)
        refs.append(reference(q[starts[s] : starts[s + 1]], keys, values, pos, scale, window))
    return out, plain, torch.cat(refs)


# (group, head_dim, window, page_major): GQA groups 4, 2 and 3 (not a power of two), a
# non-power-of-two head_dim, windows ending mid-block, contiguous and strided caches.
ATTENTION_CASES = [
    pytest.param(4, 64, None, True, id="g4-d64"),
    pytest.param(2, 64, 5, False, id="g2-d64-w5-contiguous"),
    pytest.param(2, 64, 48, True, id="g2-d64-w48"),
    pytest.param(3, 80, None, True, id="g3-d80"),
]


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("group,head_dim,window,page_major", ATTENTION_CASES)
def test_decode_quantized_matches_dequantized(kv_dtype, group, head_dim, window, page_major):
    """fp32 queries: the quantized kernel equals the plain kernel on the dequantized caches to
    fp32 rounding, and a float64 reference to 1e-5. Three splits over lengths around block
    boundaries (most splits of the short ones empty)."""
    out, plain, ref = run_decode([1, 17, 40, 70], group, head_dim, kv_dtype, torch.float32,
                                 seed=group * head_dim, num_splits=3, window=window,
                                 page_major=page_major)
    assert rel_err(out, plain) <= 2e-6
    assert rel_err(out, ref) <= 1e-5


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("group,head_dim,window,page_major", ATTENTION_CASES)
def test_prefill_quantized_matches_dequantized(kv_dtype, group, head_dim, window, page_major):
    """A mixed batch (decodes, whole prompts on and around block boundaries, chunks after a
    cached prefix), fp32 queries, compared as in the decode test."""
    seqs = [(1, 1), (1, 35), (16, 16), (17, 17), (15, 47), (20, 60)]
    out, plain, ref = run_prefill(seqs, group, head_dim, kv_dtype, torch.float32,
                                  seed=group * head_dim, window=window, page_major=page_major)
    assert rel_err(out, plain) <= 2e-6
    assert rel_err(out, ref) <= 1e-5


# The engine's 8-bit layout (V token-minor: read a block at a time): no window, a window ending
# mid-block (decode reads the hidden keys before it in its block), a padded head_dim.
TOKEN_MINOR_CASES = [
    pytest.param(4, 64, None, id="g4-d64"),
    pytest.param(2, 64, 21, id="g2-d64-w21"),
    pytest.param(3, 80, None, id="g3-d80"),
]


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("group,head_dim,window", TOKEN_MINOR_CASES)
def test_token_minor_values_match_the_reference(kv_dtype, group, head_dim, window):
    """V stored token-minor, gathered whole blocks at a time (``tile_attention.v_pages``), NaN
    in the rows a kernel reads but must not use (past each sequence's end in its last block,
    before the window in its first): decode
    (lengths around block and tile boundaries, three splits, and one split) and a mixed prefill
    batch equal the same kernels on the dequantized caches in the usual layout to fp32 rounding,
    and the float64 reference to 1e-5."""
    for lens, splits in (([1, 17, 40, 70, 200], 3), ([33, 129, 150], 1)):
        out, plain, ref = run_decode(lens, group, head_dim, kv_dtype, torch.float32,
                                     seed=group + head_dim, num_splits=splits, window=window,
                                     token_minor=True)
        assert rel_err(out, plain) <= 2e-6
        assert rel_err(out, ref) <= 1e-5
    seqs = [(1, 1), (1, 35), (16, 16), (17, 17), (15, 47), (20, 60), (70, 150)]
    out, plain, ref = run_prefill(seqs, group, head_dim, kv_dtype, torch.float32,
                                  seed=group * head_dim, window=window, token_minor=True)
    assert rel_err(out, plain) <= 2e-6
    assert rel_err(out, ref) <= 1e-5


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("q_dtype", [torch.float32, *LOW_DTYPES])
def test_prefill_over_dequantized_pages(kv_dtype, q_dtype):
    """Long chunks over an 8-bit cache attend over a scratch copy dequantized first
    (``dequantize_pages``): exactly the unquantized kernel over ``kv_quant.dequantize`` of the
    cache, with V token-minor, NaN in the rows past each sequence's end and in the tables'
    padding block; and the float64 reference to 1e-5 (fp32) / 1e-2."""
    seqs = [(1, 35), (16, 16), (17, 17), (15, 47), (20, 60), (70, 150)]
    tol = 1e-5 if q_dtype == torch.float32 else 1e-2
    out, plain, ref = run_prefill(seqs, 4, 80, kv_dtype, q_dtype, seed=21, token_minor=True,
                                  dequantize=True)
    assert torch.equal(out, plain)
    assert rel_err(out, ref) <= tol


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("q_dtype", LOW_DTYPES)
def test_quantized_with_half_precision_queries(kv_dtype, q_dtype):
    """bf16 / fp16 queries (the tiles convert to q's dtype; the values' scales fold into the
    probabilities in that dtype) against the float64 reference, 1e-2 as for unquantized caches."""
    out, _, ref = run_decode([1, 17, 70], 4, 64, kv_dtype, q_dtype, seed=3, num_splits=2)
    assert rel_err(out, ref) <= 1e-2
    out, _, ref = run_prefill([(1, 33), (20, 50), (16, 16)], 4, 64, kv_dtype, q_dtype, seed=4,
                              window=20)
    assert rel_err(out, ref) <= 1e-2
    # head_dim 128: the engine's 8-bit decode shape (``QUANTIZED_TILES``: 32-key tiles of two
    # token-minor blocks; blocks of 64 widen the tile to one block), the default splits and one,
    # a window ending mid-block
    for splits, window, block_size in ((None, None, 16), (1, 21, 16), (None, 21, 64)):
        out, _, ref = run_decode([1, 17, 40, 70, 150], 2, 128, kv_dtype, q_dtype, seed=5,
                                 num_splits=splits, window=window, token_minor=True,
                                 block_size=block_size)
        assert rel_err(out, ref) <= 1e-2


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_write_then_attend(kv_dtype):
    """write_kv quantizes a prompt's K/V into the cache; prefill over it equals attention over
    ``kv_quant``'s dequantization of the same K/V."""
    gen = torch.Generator().manual_seed(8)
    # three pages out of order, the last one partial (8 + 8 + 3 tokens): the interpreter's fp8
    # write (a 16-candidate scale search per row) costs per token
    block_size, head_dim, group, n = 8, 64, 2, 19
    storage = kv_quant.TORCH_DTYPES[kv_dtype]
    k_cache = torch.zeros(4, block_size, NUM_KV_HEADS, head_dim, dtype=storage, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    k_scale = torch.zeros(4, block_size, NUM_KV_HEADS, device=DEVICE)
    v_scale = torch.zeros_like(k_scale)
    k, v = random_rows(gen, 2, n, NUM_KV_HEADS, head_dim).to(DEVICE)
    q = torch.randn(n, NUM_KV_HEADS * group, head_dim, generator=gen).to(DEVICE)
    table = torch.tensor([[3, 1, 2]], dtype=torch.int32, device=DEVICE)
    pos = torch.arange(n, device=DEVICE)
    slots = table[0, pos // block_size].long() * block_size + pos % block_size
    write_kv(k, v, k_cache, v_cache, slots, k_scale=k_scale, v_scale=v_scale)
    out = paged_prefill_attention(q, k_cache, v_cache, table,
                                  torch.tensor([0, n], dtype=torch.int32, device=DEVICE),
                                  torch.tensor([n], dtype=torch.int32, device=DEVICE), n, 0.125,
                                  k_scale=k_scale, v_scale=v_scale)
    keys = kv_quant.dequantize(*kv_quant.quantize(k, kv_dtype), torch.float64)
    values = kv_quant.dequantize(*kv_quant.quantize(v, kv_dtype), torch.float64)
    assert rel_err(out, reference(q, keys, values, pos, 0.125)) <= 1e-5


def test_quantized_inputs_are_checked():
    gen = torch.Generator().manual_seed(0)
    paged = QuantPaged([5], 16, 64, "int8", gen)
    q = torch.randn(1, NUM_KV_HEADS, 64, device=DEVICE)
    args = (q, paged.k_cache, paged.v_cache, paged.block_tables, paged.seq_lens_t, 0.1)
    with pytest.raises(AssertionError):  # a quantized cache without scales
        paged_decode_attention(*args)
    with pytest.raises(AssertionError):  # one scale without the other
        paged_decode_attention(*args, k_scale=paged.k_scale)
    with pytest.raises(AssertionError):  # scales of the wrong dtype
        paged_decode_attention(*args, k_scale=paged.k_scale.double(), v_scale=paged.v_scale.double())
    k_deq, v_deq = paged.dequantized(torch.float32)
    with pytest.raises(AssertionError):  # scales beside an unquantized cache
        paged_decode_attention(q, k_deq, v_deq, paged.block_tables, paged.seq_lens_t, 0.1,
                               **paged.scales)
    with pytest.raises(AssertionError):
        paged_prefill_attention(q, paged.k_cache, paged.v_cache, paged.block_tables,
                                torch.tensor([0, 1], dtype=torch.int32, device=DEVICE),
                                paged.seq_lens_t, 1, 0.1)


# -------------------------------------------------------------------------------------- CUDA only


@cuda_only
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_quantized_long_context(kv_dtype, q_dtype):
    tol = 1e-5 if q_dtype == torch.float32 else 1e-2
    out, _, ref = run_decode([16385, 4096, 999, 1], 8, 128, kv_dtype, q_dtype, seed=11)
    assert rel_err(out, ref) <= tol
    out, _, ref = run_prefill([(512, 8192), (2000, 2000), (1, 5000)], 4, 128, kv_dtype, q_dtype,
                              seed=13, window=1024)
    assert rel_err(out, ref) <= tol


@cuda_only
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_quantized_write_and_decode_replay_in_cuda_graph(kv_dtype):
    """Capture quantizing write_kv + decode once; replays with new contents of the same buffers
    match the reference over the caches as the replay left them."""
    gen = torch.Generator().manual_seed(5)
    lens = [500, 17, 2048, 1]
    paged = QuantPaged(lens, 16, 128, kv_dtype, gen)
    batch, heads = len(lens), NUM_KV_HEADS * 4
    q = torch.empty(batch, heads, 128, device=DEVICE, dtype=torch.bfloat16)
    k_new = torch.empty(batch, NUM_KV_HEADS, 128, device=DEVICE, dtype=torch.bfloat16)
    v_new = torch.empty_like(k_new)
    last = paged.seq_lens_t.long() - 1
    slots = paged.block_tables[torch.arange(batch, device=DEVICE), last // 16].long() * 16 + last % 16
    out = torch.empty_like(q)

    def step():
        write_kv(k_new, v_new, paged.k_cache, paged.v_cache, slots, **paged.scales)
        paged_decode_attention(q, paged.k_cache, paged.v_cache, paged.block_tables,
                               paged.seq_lens_t, 0.1, out=out, **paged.scales)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for seed in range(2):
        g = torch.Generator().manual_seed(100 + seed)
        for t in (q, k_new, v_new):
            t.copy_(torch.randn(t.shape, generator=g))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        new_k_scale = paged.k_scale[slots // 16, slots % 16]
        torch.testing.assert_close(new_k_scale, kv_quant.quantize(k_new, kv_dtype)[1], rtol=1e-6,
                                   atol=0)
        refs = []
        for b, n in enumerate(lens):
            keys, values = paged.context(b)
            refs.append(reference(q[b : b + 1], keys, values, torch.tensor([n - 1], device=DEVICE), 0.1))
        assert rel_err(out, torch.cat(refs)) <= 1e-2
