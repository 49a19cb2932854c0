"""The Triton paged-attention kernels (kvos.kernels) against a float64 torch reference.

On CUDA the kernels run compiled, in fp32, bf16 and fp16, up to 32K-token contexts. Without a GPU
they run in Triton's interpreter on CPU tensors with small shapes (fp32 and fp16: the
interpreter's dot cannot multiply bf16). Errors are ``||out - ref|| / ||ref||``: at most 1e-5
for fp32 (exact "ieee" dots), 1e-2 for bf16/fp16. Every output starts as NaN, so an element
the kernel fails to write fails the test.
"""
from __future__ import annotations

import pytest
import torch

from tests.support.triton_interpreter import (  # first: before triton loads
    CUDA,
    skip_unless_interpreted,
)

triton = pytest.importorskip("triton")

from kvos.kernels import decode_attention as _decode  # noqa: E402
from kvos.kernels.cache_write import write_kv  # noqa: E402
from kvos.kernels.prefill_attention import paged_prefill_attention  # noqa: E402

pytestmark = pytest.mark.gpu

paged_decode_attention = _decode.paged_decode_attention
decode_num_splits = _decode.decode_num_splits

skip_unless_interpreted(_decode._decode_split_kernel)

DEVICE = torch.device("cuda" if CUDA else "cpu")
DTYPES = ([torch.float32, torch.bfloat16, torch.float16] if CUDA else [torch.float32, torch.float16])
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}
cuda_only = pytest.mark.skipif(not CUDA, reason="big shapes: CUDA only")
NUM_KV_HEADS = 2


class Paged:
    """Random caches and random (permuted) block tables for sequences of the given lengths.

    The caches are ``[layer 1, 0]`` and ``[layer 1, 1]`` of a ``[2, 2, blocks, block_size, KVH,
    D]`` tensor, or with ``page_major`` ``[:, layer 1, 0]`` and ``[:, layer 1, 1]`` of a
    ``[blocks, 3, 2, block_size, KVH, D]`` pool (one block holds all layers of a layer group, so
    the block stride is 6 blocks' worth). Every slot, the null block 0 and the slots past each
    sequence's length included, holds random data, so reading the wrong key changes the result.
    """

    def __init__(self, seq_lens: list[int], block_size: int, head_dim: int, dtype: torch.dtype,
                 gen: torch.Generator, num_kv_heads: int = NUM_KV_HEADS, spare_columns: int = 2,
                 page_major: bool = False):
        self.seq_lens, self.block_size = seq_lens, block_size
        counts = [-(-n // block_size) for n in seq_lens]
        num_blocks = 1 + sum(counts) + 3
        if page_major:
            kv = torch.randn(num_blocks, 3, 2, block_size, num_kv_heads, head_dim, generator=gen)
            kv = kv.to(DEVICE, dtype)
            self.k_cache, self.v_cache = kv[:, 1, 0], kv[:, 1, 1]
        else:
            kv = torch.randn(2, 2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
            kv = kv.to(DEVICE, dtype)
            self.k_cache, self.v_cache = kv[1, 0], kv[1, 1]
        ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
        self.block_tables = torch.zeros(len(seq_lens), max(counts, default=0) + spare_columns,
                                        dtype=torch.int32)
        for i, n in enumerate(counts):
            self.block_tables[i, :n] = torch.tensor(ids[:n], dtype=torch.int32)
            ids = ids[n:]
        self.block_tables = self.block_tables.to(DEVICE)
        self.full_tables = self.block_tables.clone()
        self.seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)

    def drop_blocks_before(self, first_keys: list[int]) -> None:
        """Point sequence s's blocks wholly before key ``first_keys[s]`` at the null block 0, as
        an engine freeing blocks that slid out of every window, and fill block 0 with NaN, so a
        kernel that reads any of them returns NaN. ``context`` still sees the original blocks."""
        for s, first in enumerate(first_keys):
            self.block_tables[s, : max(0, first) // self.block_size] = 0
        self.k_cache[0] = float("nan")
        self.v_cache[0] = float("nan")

    def context(self, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence ``seq``'s keys and values in position order, float64 ``[len, KVH, D]``."""
        pos = torch.arange(self.seq_lens[seq], device=DEVICE)
        blocks = self.full_tables[seq, pos // self.block_size].long()
        offsets = pos % self.block_size
        return (self.k_cache[blocks, offsets].double(), self.v_cache[blocks, offsets].double())


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, q_pos: torch.Tensor,
              scale: float, chunk: int = 256, window: int | None = None) -> torch.Tensor:
    """float64 attention of q ``[n, H, D]`` at positions q_pos over keys/values ``[L, KVH, D]``:
    query at position p sees keys ``0 .. p``, with a window only keys ``p - window < j <= p``;
    query head h reads kv head ``h // (H // KVH)``."""
    group = q.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(group, dim=1)
    v = values.repeat_interleave(group, dim=1)
    key_pos = torch.arange(keys.shape[0], device=q.device)
    outs = []
    for i in range(0, q.shape[0], chunk):
        qc, pc = q[i : i + chunk].double(), q_pos[i : i + chunk]
        s = torch.einsum("nhd,lhd->hnl", qc, k) * scale
        hidden = key_pos[None, :] > pc[:, None]
        if window:
            hidden |= key_pos[None, :] <= pc[:, None] - window
        s = s.masked_fill(hidden[None], float("-inf"))
        outs.append(torch.einsum("hnl,lhd->nhd", s.softmax(-1), v))
    return torch.cat(outs)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any(), "output elements left unwritten (NaN poison) or NaN"
    return ((out.double() - ref).norm() / ref.norm()).item()


def decode_reference(paged: Paged, q: torch.Tensor, scale: float,
                     window: int | None = None) -> torch.Tensor:
    rows = []
    for b, n in enumerate(paged.seq_lens):
        keys, values = paged.context(b)
        pos = torch.tensor([n - 1], device=DEVICE)
        rows.append(reference(q[b : b + 1], keys, values, pos, scale, window=window))
    return torch.cat(rows)


def run_decode(seq_lens, group, head_dim, block_size, dtype, seed, num_splits=None, window=None,
               page_major=False):
    """With a window, blocks wholly before each sequence's window are dropped to a NaN block 0."""
    gen = torch.Generator().manual_seed(seed)
    paged = Paged(seq_lens, block_size, head_dim, dtype, gen, page_major=page_major)
    if window:
        paged.drop_blocks_before([n - window for n in seq_lens])
    q = torch.randn(len(seq_lens), NUM_KV_HEADS * group, head_dim, generator=gen).to(DEVICE, dtype)
    scale = head_dim ** -0.5
    out = torch.full_like(q, float("nan"))
    res = paged_decode_attention(q, paged.k_cache, paged.v_cache, paged.block_tables,
                                 paged.seq_lens_t, scale, out=out, num_splits=num_splits,
                                 window=window)
    assert res is out
    return out, decode_reference(paged, q, scale, window)


def run_prefill(seqs, group, head_dim, block_size, dtype, seed, window=None, page_major=False):
    """seqs: (query length, total length) per sequence. With a window, blocks wholly before the
    window of each sequence's first new token are dropped to a NaN block 0."""
    gen = torch.Generator().manual_seed(seed)
    paged = Paged([n for _, n in seqs], block_size, head_dim, dtype, gen, page_major=page_major)
    if window:
        paged.drop_blocks_before([n - q_len - window + 1 for q_len, n in seqs])
    num_heads = NUM_KV_HEADS * group
    total = sum(q for q, _ in seqs)
    # q is a strided view, as when it is split off a fused QKV projection.
    qkv = torch.randn(total, num_heads + 2 * NUM_KV_HEADS, head_dim, generator=gen).to(DEVICE, dtype)
    q = qkv[:, :num_heads]
    starts = [0]
    for q_len, _ in seqs:
        starts.append(starts[-1] + q_len)
    query_start_loc = torch.tensor(starts, dtype=torch.int32, device=DEVICE)
    scale = head_dim ** -0.5
    out = torch.full_like(q, float("nan"))
    res = paged_prefill_attention(q, paged.k_cache, paged.v_cache, paged.block_tables,
                                  query_start_loc, paged.seq_lens_t, max(q for q, _ in seqs), scale,
                                  out=out, window=window)
    assert res is out
    refs = []
    for s, (q_len, n) in enumerate(seqs):
        keys, values = paged.context(s)
        pos = torch.arange(n - q_len, n, device=DEVICE)
        q_seq = q[starts[s] : starts[s + 1]]
        refs.append(reference(q_seq, keys, values, pos, scale, window=window))
    return out, torch.cat(refs)


def shape_grid() -> list:
    """GQA group x head_dim x block_size x dtype: all of it on CUDA; under the interpreter, to keep
    the CPU run short, every group x head_dim pair in fp32 with both block sizes for each group and
    each head_dim (alternating), and a slice in fp16."""
    params = []
    for dtype in DTYPES:
        for gi, group in enumerate((1, 4, 8)):
            for di, head_dim in enumerate((64, 128, 256)):
                for block_size in (16, 32):
                    alternate = block_size == (16, 32)[(gi + di) % 2]
                    if CUDA or (dtype == torch.float32 and alternate) or (
                            dtype != torch.float32 and group == 4 and block_size == 16):
                        name = f"g{group}-d{head_dim}-bs{block_size}-{str(dtype)[6:]}"
                        params.append(pytest.param(group, head_dim, block_size, dtype, id=name))
    return params


SHAPE_GRID = shape_grid()


def boundary_lens(block_size: int) -> list[int]:
    """Lengths around block boundaries, a single token, and a few blocks."""
    return [1, block_size - 1, block_size, block_size + 1, 2 * block_size, 3 * block_size + 5]


# ---------------------------------------------------------------------------------------- write_kv


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("cache_dtype", DTYPES)
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_write_kv_writes_its_slots_and_nothing_else(block_size, cache_dtype, slot_dtype):
    gen = torch.Generator().manual_seed(block_size)
    head_dim, tokens = 64, 13
    num_blocks = 1 + -(-2 * tokens // block_size)
    kv = torch.randn(2, 2, num_blocks, block_size, NUM_KV_HEADS, head_dim, generator=gen)
    kv = kv.to(DEVICE, cache_dtype)
    k_cache, v_cache = kv[1, 0], kv[1, 1]
    before = kv.clone()
    # k and v as strided views of one fp32 tensor: the kernel casts to the cache dtype.
    kv_new = torch.randn(tokens, 2 * NUM_KV_HEADS, head_dim, generator=gen).to(DEVICE)
    k, v = kv_new[:, :NUM_KV_HEADS], kv_new[:, NUM_KV_HEADS:]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[::4] = -1  # padding rows: skipped
    write_kv(k, v, k_cache, v_cache, slots.to(DEVICE, slot_dtype))

    expected = before.clone()
    kept = slots >= 0
    flat = expected[1].view(2, num_blocks * block_size, NUM_KV_HEADS, head_dim)
    flat[0, slots[kept]] = k[kept.to(DEVICE)].to(cache_dtype)
    flat[1, slots[kept]] = v[kept.to(DEVICE)].to(cache_dtype)
    assert torch.equal(kv, expected)


@pytest.mark.parametrize("block_size", [1, 16])
def test_write_kv_into_page_major_view(block_size):
    """The caches as ``[:, layer, 0]`` / ``[:, layer, 1]`` views of a page-major pool ``[blocks,
    layers, 2, block_size, KVH, D]``: the writes land in that layer's slots, and nowhere else."""
    gen = torch.Generator().manual_seed(block_size)
    head_dim, tokens, num_blocks = 64, 13, 1 + -(-26 // block_size)
    pool = torch.randn(num_blocks, 3, 2, block_size, NUM_KV_HEADS, head_dim, generator=gen)
    pool = pool.to(DEVICE)
    before = pool.clone()
    k, v = torch.randn(2, tokens, NUM_KV_HEADS, head_dim, generator=gen).to(DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    write_kv(k, v, pool[:, 1, 0], pool[:, 1, 1], slots.to(DEVICE))

    expected = before.clone()
    blocks, offsets = slots // block_size, slots % block_size
    expected[blocks, 1, 0, offsets] = k
    expected[blocks, 1, 1, offsets] = v
    assert torch.equal(pool, expected)


# ----------------------------------------------------------------------------------------- decode


@pytest.mark.parametrize("group,head_dim,block_size,dtype", SHAPE_GRID)
def test_decode_matches_reference(group, head_dim, block_size, dtype):
    lens = boundary_lens(block_size)
    out, ref = run_decode(lens, group, head_dim, block_size, dtype, seed=group * head_dim + block_size,
                          num_splits=3)
    assert rel_err(out, ref) <= TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_split_counts_agree(dtype):
    """1 split (direct write), several, a count that does not divide the context, and more
    splits than tiles, so that most splits are empty and must be ignored by the combine."""
    lens = [1, 17, 70, 131]
    outs = []
    for num_splits in (1, 2, 7, 24):
        out, ref = run_decode(lens, 4, 64, 16, dtype, seed=7, num_splits=num_splits)
        assert rel_err(out, ref) <= TOL[dtype], num_splits
        outs.append(out.double())
    for out in outs[1:]:
        assert rel_err(out, outs[0]) <= (1e-6 if dtype == torch.float32 else TOL[dtype])


def test_decode_default_splits_and_padding_row():
    """num_splits from the shapes; int64 tables and lengths as the engine builds them; a padding
    row with seq_len 0 (as in a CUDA graph) gets zeros and leaves the other rows alone."""
    gen = torch.Generator().manual_seed(3)
    paged = Paged([40, 1, 300], 16, 64, torch.float32, gen)
    seq_lens = paged.seq_lens_t.long()
    seq_lens[1] = 0
    q = torch.randn(3, NUM_KV_HEADS * 2, 64, generator=gen).to(DEVICE)
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, paged.k_cache, paged.v_cache, paged.block_tables.long(), seq_lens,
                           0.125, out=out)
    ref = decode_reference(paged, q, 0.125)
    keep = torch.tensor([0, 2], device=DEVICE)
    assert rel_err(out[keep], ref[keep]) <= 1e-5
    assert torch.equal(out[1], torch.zeros_like(out[1]))


def test_decode_num_splits_heuristic():
    assert decode_num_splits(1, 8, 2048, 16) == 32  # ~2 waves of 132 SMs over 8 heads, a power of 2
    assert decode_num_splits(3, 8, 2048, 16) == 8  # 11, rounded down to a power of two
    assert decode_num_splits(1, 8, 4, 16) == 1  # 64 keys: one split
    assert decode_num_splits(1, 8, 40, 16) == 2  # 640 keys: at least 256 per split
    assert decode_num_splits(256, 8, 2048, 16) == 1  # enough programs already
    assert decode_num_splits(1, 1, 1 << 20, 16) == _decode.MAX_SPLITS
    assert decode_num_splits(4, 2, 2048, 32, num_sms=16) == 4
    assert decode_num_splits(64, 8, 2048, 16, programs_per_sm=8) == 2  # 8 programs per SM: 3 splits, rounded down


def test_decode_tiles_measured_shapes_only_for_measured_heads():
    measured = _decode.decode_tiles(128, torch.bfloat16, quantized=True)
    assert measured == _decode.QUANTIZED_TILES and measured.block_n % 16 == 0  # v_pages at block 16
    for dtype in (torch.bfloat16, torch.float16):
        assert _decode.decode_tiles(128, dtype, quantized=False) == _decode.HALF_TILES
    for other in (_decode.decode_tiles(256, torch.bfloat16, quantized=True),
                  _decode.decode_tiles(128, torch.float32, quantized=True),
                  _decode.decode_tiles(128, torch.float32, quantized=False),
                  _decode.decode_tiles(64, torch.bfloat16, quantized=False),
                  _decode.decode_tiles(256, torch.bfloat16, quantized=False)):
        assert other.num_stages <= 3 and other.programs_per_sm == 2 and other.max_registers is None


@cuda_only
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,group", [(128, 8), (64, 4), (256, 1)])
def test_decode_long_context(dtype, head_dim, group):
    lens = [32768, 32767, 16385, 4096, 999, 1]
    out, ref = run_decode(lens, group, head_dim, 16, dtype, seed=11)
    assert rel_err(out, ref) <= TOL[dtype]


@cuda_only
def test_decode_and_write_kv_replay_in_cuda_graph():
    """Capture write_kv + decode once; replays with new contents of the same buffers match."""
    gen = torch.Generator().manual_seed(5)
    lens = [500, 17, 2048, 1]
    paged = Paged(lens, 16, 128, torch.bfloat16, gen)
    batch, heads = len(lens), NUM_KV_HEADS * 4
    q = torch.empty(batch, heads, 128, device=DEVICE, dtype=torch.bfloat16)
    k_new = torch.empty(batch, NUM_KV_HEADS, 128, device=DEVICE, dtype=torch.bfloat16)
    v_new = torch.empty_like(k_new)
    last = paged.seq_lens_t.long() - 1
    slots = paged.block_tables[torch.arange(batch, device=DEVICE), last // 16].long() * 16 + last % 16
    out = torch.empty_like(q)

    def step():
        write_kv(k_new, v_new, paged.k_cache, paged.v_cache, slots)
        paged_decode_attention(q, paged.k_cache, paged.v_cache, paged.block_tables,
                               paged.seq_lens_t, 0.1, out=out)

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
        assert rel_err(out, decode_reference(paged, q, 0.1)) <= 1e-2


# ---------------------------------------------------------------------------------------- prefill


def mixed_batch(block_size: int) -> list[tuple[int, int]]:
    """(query length, total length): a lone token, decodes, whole prompts ending on and around
    block boundaries, and chunks after a cached prefix."""
    b = block_size
    return [(1, 1), (1, 2 * b + 3), (b, b), (b + 1, b + 1), (b - 1, 3 * b - 1), (40, 40 + 2 * b),
            (1, b)]


@pytest.mark.parametrize("group,head_dim,block_size,dtype", SHAPE_GRID)
def test_prefill_matches_reference(group, head_dim, block_size, dtype):
    out, ref = run_prefill(mixed_batch(block_size), group, head_dim, block_size, dtype,
                           seed=group * head_dim + block_size)
    assert rel_err(out, ref) <= TOL[dtype]


@pytest.mark.parametrize("head_dim", [32, 80, 96])
def test_odd_head_dims(head_dim):
    """Head dims that are not a power of two run padded to one, with masks."""
    out, ref = run_prefill([(5, 5), (20, 50), (1, 33)], 2, head_dim, 16, torch.float32, seed=head_dim)
    assert rel_err(out, ref) <= 1e-5
    out, ref = run_decode([1, 33, 100], 2, head_dim, 16, torch.float32, seed=head_dim, num_splits=2)
    assert rel_err(out, ref) <= 1e-5


@pytest.mark.parametrize("block_size", [1, 8])
def test_other_block_sizes(block_size):
    """Keys are gathered one by one through the table, so any block size works."""
    out, ref = run_prefill([(5, 5), (20, 50), (1, 33)], 2, 64, block_size, torch.float32, seed=1)
    assert rel_err(out, ref) <= 1e-5
    out, ref = run_decode([1, 33, 100], 2, 64, block_size, torch.float32, seed=1, num_splits=2)
    assert rel_err(out, ref) <= 1e-5


def test_prefill_non_power_of_two_group():
    out, ref = run_prefill([(17, 17), (3, 40), (1, 9)], 3, 64, 16, torch.float32, seed=9)
    assert rel_err(out, ref) <= 1e-5
    out, ref = run_decode([17, 40, 9], 3, 64, 16, torch.float32, seed=9, num_splits=2)
    assert rel_err(out, ref) <= 1e-5


@cuda_only
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,group", [(128, 8), (64, 4), (256, 1)])
def test_prefill_long_context(dtype, head_dim, group):
    seqs = [(512, 32768), (4096, 4096), (1, 20000), (2000, 9000)]
    out, ref = run_prefill(seqs, group, head_dim, 16, dtype, seed=13)
    assert rel_err(out, ref) <= TOL[dtype]


def test_shapes_are_checked():
    gen = torch.Generator().manual_seed(0)
    paged = Paged([5], 16, 64, torch.float32, gen)
    q = torch.randn(1, 3, 64, device=DEVICE)  # 3 heads over 2 kv heads
    with pytest.raises(AssertionError):
        paged_decode_attention(q, paged.k_cache, paged.v_cache, paged.block_tables,
                               paged.seq_lens_t, 0.1)


# --------------------------------------------------------------------------------- sliding window


def window_grid() -> list:
    """Window (None, a single token, inside one block, a few blocks, longer than any context) x
    GQA group x head_dim (256: Gemma 3's) x dtype x cache layout (page-major: strided views of a
    pool), kept small for the interpreter."""
    configs = [(4, 64, torch.float32, False, (None, 1, 5, 48, 1000)),
               (2, 256, torch.float32, True, (None, 5, 48, 1000)),
               (2, 128, torch.float16, True, (5, 48))]
    params = []
    for group, head_dim, dtype, page_major, windows in configs:
        for window in windows:
            name = f"w{window}-g{group}-d{head_dim}-{str(dtype)[6:]}" + ("-pagemajor" * page_major)
            params.append(pytest.param(window, group, head_dim, dtype, page_major, id=name))
    return params


WINDOW_GRID = window_grid()


@pytest.mark.parametrize("window,group,head_dim,dtype,page_major", WINDOW_GRID)
def test_decode_sliding_window(window, group, head_dim, dtype, page_major):
    """Each token sees its last ``window`` keys; windows end mid-block, and the table points
    blocks before the window at a NaN block 0 (so reading one fails). The splits divide the
    window, from one split to more splits than the window has tiles."""
    lens = [1, 17, 70, 131]  # block 16: 70 - 5, 131 - 5, 70 - 48, 131 - 48 all fall mid-block
    for num_splits in (None, 3, 8):  # None: 1 here (direct write)
        out, ref = run_decode(lens, group, head_dim, 16, dtype, seed=21, num_splits=num_splits,
                              window=window, page_major=page_major)
        assert rel_err(out, ref) <= TOL[dtype], num_splits


@pytest.mark.parametrize("window,group,head_dim,dtype,page_major", WINDOW_GRID)
def test_prefill_sliding_window(window, group, head_dim, dtype, page_major):
    """A mixed batch: decodes, whole prompts, and chunks over cached prefixes longer than the
    window, whose first token's window starts mid-block; blocks before it point at a NaN block 0.
    With head_dim 256 (16-key tiles in fp32) the 48 window leaves whole tiles that every row of a
    query tile sees, so the masked-below, unmasked and masked-above ranges all run."""
    seqs = [(1, 1), (1, 35), (16, 16), (17, 17), (15, 47), (20, 120), (40, 75)]
    out, ref = run_prefill(seqs, group, head_dim, 16, dtype, seed=23, window=window,
                           page_major=page_major)
    assert rel_err(out, ref) <= TOL[dtype]


def test_window_larger_than_context_is_full_attention():
    """A window covering every context gives full causal attention up to rounding."""
    lens = [3, 40, 77]
    full, _ = run_decode(lens, 2, 64, 16, torch.float32, seed=5, num_splits=2)
    windowed, _ = run_decode(lens, 2, 64, 16, torch.float32, seed=5, num_splits=2, window=77)
    assert rel_err(windowed, full.double()) <= 1e-6
    seqs = [(3, 3), (20, 40), (1, 77)]
    full, _ = run_prefill(seqs, 2, 64, 16, torch.float32, seed=5)
    windowed, _ = run_prefill(seqs, 2, 64, 16, torch.float32, seed=5, window=77)
    assert rel_err(windowed, full.double()) <= 1e-6
