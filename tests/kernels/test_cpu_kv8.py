"""The CPU kernels for 8-bit KV caches (``kvos.kernels.cpu.paged_kv8``) against their definitions:
the write's bytes and scales equal ``kv_quant.quantize``'s (int8 and fp8: zero rows, a negative
zero, fp8 subnormals, an fp8 scale tie, values halfway between two codes), padding slots and every other slot untouched; decode
attention equals a float64 reference over ``kv_quant.dequantize`` of the cache to float32
rounding (GQA, windows ending mid-block, shuffled blocks, V token-minor, strided scales).
Skipped where the kernels cannot be built (no compiler or no AVX2)."""
from __future__ import annotations

import pytest
import torch

from kvos.kernels import kv_quant
from kvos.kernels.cpu.build import library
from kvos.kernels.cpu.paged_kv8 import decode_attention_kv8, view_of, write_kv8
from kvos.worker.runner import token_minor

pytestmark = pytest.mark.skipif(library() is None, reason="CPU kernels not built here (no C compiler or AVX2)")

DTYPES = ["int8", "fp8_e4m3"]
BS, KVH = 16, 2


def pool(kv_dtype: str, num_blocks: int, head_dim: int, gen: torch.Generator):
    """K, V (token-minor) and their scales as the engine lays them out: views into page-major
    pools of two layer slots (layer 1 taken), filled with random bytes and scales."""
    storage = kv_quant.TORCH_DTYPES[kv_dtype]
    raw = torch.randint(-100, 100, (num_blocks, 2, 2, BS, KVH, head_dim), generator=gen, dtype=torch.int8)
    data = raw.view(storage) if kv_dtype == "int8" else (raw & 0x77).view(storage)  # no fp8 NaN codes
    scales = torch.rand(num_blocks, 2, 2, BS, KVH, generator=gen)
    return data[:, 1, 0], token_minor(data[:, 1, 1]), scales[:, 1, 0], scales[:, 1, 1]


@pytest.mark.parametrize("kv_dtype", DTYPES)
def test_write_equals_quantize_bit_for_bit(kv_dtype):
    gen = torch.Generator().manual_seed(1)
    head_dim, tokens, blocks = 64, 23, 6
    k, v, ks, vs = pool(kv_dtype, blocks, head_dim, gen)
    before = [x.clone() for x in (k, v, ks, vs)]
    kv = torch.randn(tokens, 2 * KVH, head_dim, generator=gen) * torch.exp(torch.randn(tokens, 2 * KVH, 1, generator=gen))
    kv[1, 0] = 0.0  # a row of zeros: scale 0
    kv[2, 1, :3] = torch.tensor([3e-5, -2e-5, -0.0])  # fp8 subnormals, a negative zero
    kv[3, 2] = 0.0  # fp8: candidates m = 1 and 7/4 both exact, a tie (the first wins)
    kv[3, 2, :3] = torch.tensor([56.0, -28.0, 14.0])
    kv[4, 3, :4] = torch.tensor([127.0, 2.5, -3.5, 0.5])  # int8 scale 1: exact .5 ties
    kv[6, 0] = 0.0  # fp8 scale 1 (j = 0 wins); then halfway between two subnormals, two normals
    kv[6, 0, :3] = torch.tensor([448.0, 0.0048828125, 0.056640625])
    slots = torch.randperm(blocks * BS, generator=gen)[:tokens]
    slots[5::7] = -1  # padding rows: skipped
    write_kv8(kv[:, :KVH], kv[:, KVH:], view_of(k, v, ks, vs), slots, BS)
    kept = slots >= 0
    b, o = slots[kept] // BS, slots[kept] % BS
    untouched = torch.ones(blocks, BS, dtype=torch.bool)
    untouched[b, o] = False
    for x, data, scales, old, old_scales in ((kv[kept, :KVH], k, ks, before[0], before[2]),
                                            (kv[kept, KVH:], v, vs, before[1], before[3])):
        want, want_scale = kv_quant.quantize(x, kv_dtype)
        assert torch.equal(data[b, o].view(torch.uint8), want.view(torch.uint8))
        assert torch.equal(scales[b, o], want_scale)
        assert torch.equal(data[untouched].view(torch.uint8), old[untouched].view(torch.uint8))
        assert torch.equal(scales[untouched], old_scales[untouched])


def reference(q, k, v, ks, vs, table, n, scale, window):
    """float64 attention of one query ``[H, D]`` at position n - 1 over its dequantized keys."""
    lo = max(0, n - window) if window else 0
    pos = torch.arange(lo, n)
    b, o = table[pos // BS].long(), pos % BS
    group = q.shape[0] // KVH
    keys = kv_quant.dequantize(k[b, o], ks[b, o], torch.float64).repeat_interleave(group, 1)
    values = kv_quant.dequantize(v[b, o], vs[b, o], torch.float64).repeat_interleave(group, 1)
    s = torch.einsum("hd,lhd->hl", q.double(), keys) * scale
    return torch.einsum("hl,lhd->hd", s.softmax(-1), values)


@pytest.mark.parametrize("kv_dtype", DTYPES)
@pytest.mark.parametrize("group,head_dim,window", [(3, 64, None), (2, 128, 21), (1, 8, 5)])
def test_decode_attention_equals_the_dequantized_reference(kv_dtype, group, head_dim, window):
    gen = torch.Generator().manual_seed(group * head_dim)
    lens = [1, 16, 17, 40, 70]
    blocks = 1 + sum(-(-n // BS) for n in lens)
    k, v, ks, vs = pool(kv_dtype, blocks, head_dim, gen)
    tables = torch.zeros(len(lens), 6, dtype=torch.int32)
    ids = (torch.randperm(blocks - 1, generator=gen) + 1).tolist()
    for i, n in enumerate(lens):
        count = -(-n // BS)
        tables[i, :count] = torch.tensor(ids[:count], dtype=torch.int32)
        ids = ids[count:]
    q = torch.randn(len(lens), KVH * group, head_dim, generator=gen)
    out = decode_attention_kv8(q, view_of(k, v, ks, vs), KVH, BS, tables, torch.tensor(lens, dtype=torch.int32),
                               head_dim ** -0.5, window)
    ref = torch.stack([reference(q[i], k, v, ks, vs, tables[i], n, head_dim ** -0.5, window)
                       for i, n in enumerate(lens)])
    assert ((out.double() - ref).norm() / ref.norm()).item() <= 1e-6


def test_views_refuse_what_the_kernels_do_not_take():
    gen = torch.Generator().manual_seed(0)
    k, v, ks, vs = pool("int8", 2, 64, gen)
    assert view_of(k, v, ks, vs) is not None
    assert view_of(k.float(), v.float(), ks, vs) is None  # not 8-bit
    assert view_of(k, v, ks, vs.contiguous()) is None  # scales of other strides
    assert view_of(k, v, ks.double(), vs.double()) is None
