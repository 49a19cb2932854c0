"""The CPU C kernels against their definitions: GGUF blocks kept as stored equal gguf's float32
dequantization bit for bit; products with them (one row of x: from its 16-bit integer parts) equal a
float64 product of those weights within float32 rounding; paged decode attention equals the torch reference backend (GQA, windows,
shuffled blocks, a page-major pool's strides); rotary equals its torch definition bit for bit,
the norm within rounding. Skipped where the kernels cannot be built (no compiler or no AVX2)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvos.kernels.cpu.build import library
from kvos.kernels.cpu.quant_matmul import BlockQuantWeight, dequantize, matmul

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(library() is None, reason="CPU kernels not built here (no C compiler or AVX2)")


def _raw_blocks(qtype: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """GGUF bytes of a ``[rows, cols]`` tensor: gguf's quantizer where it has one, else random
    quants with finite half-precision scales."""
    from gguf.quants import quantize

    t = gguf.GGMLQuantizationType[qtype]
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols)) * rng.uniform(0.01, 3, (rows, 1)) + rng.uniform(-1, 1, (rows, 1))
    try:
        return quantize(x.astype(np.float32), t)
    except NotImplementedError:
        block, size = gguf.GGML_QUANT_SIZES[t]
        raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
        halves = rng.uniform(0.001, 0.05, (rows, cols // block, 2)).astype(np.float16).view(np.uint8)
        raw[:, :, :4] = halves.reshape(rows, cols // block, 4)  # Q4_K: d and dmin
        return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q4_K", "Q8_0", "Q5_0"])
def test_blocks_equal_gguf_dequantization_bit_for_bit(qtype):
    from gguf.quants import dequantize as reference

    from kvos.models.gguf_blocks import block_weight

    raw = _raw_blocks(qtype, 40, 512, seed=1)
    w = block_weight(raw, gguf.GGMLQuantizationType[qtype])
    ref = torch.from_numpy(np.array(reference(raw, gguf.GGMLQuantizationType[qtype]), dtype=np.float32))
    assert w.shape == (40, 512)
    assert torch.equal(dequantize(w), ref)


def test_default_model_blocks_equal_its_float_weights():
    """Every layer the default model keeps as blocks (q/k rows un-permuted) dequantizes to the
    float32 weight the model loads."""
    from kvos.models.gguf_loader import load_gguf, load_gguf_blocks
    from kvos.models.loader import default_model_path

    _, weights = load_gguf(default_model_path())
    blocks = load_gguf_blocks(default_model_path())
    assert len(blocks) == 30 * 7 + 1  # q, k, v, o, gate, up, down per layer; the embeddings
    for name, w in blocks.items():
        assert torch.equal(dequantize(w), torch.from_numpy(weights[name])), name


def _weight(form: str, n: int, k: int, seed: int) -> BlockQuantWeight:
    g = torch.Generator().manual_seed(seed)
    d = torch.rand(n, k // 32, generator=g) * 0.02
    if form == "u4":
        return BlockQuantWeight("u4", torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g), d,
                                -torch.rand(n, k // 32, generator=g) * 0.1)
    return BlockQuantWeight("i8", torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g), d)


@pytest.mark.parametrize("form", ["u4", "i8"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 9])
def test_matmul_equals_float64_product_of_the_same_weights(form, rows):
    w = _weight(form, 201, 576, seed=rows)  # odd: one row of x takes W two rows at a time, the last alone
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(7))
    x[:, 40] *= 30  # an outlier: one row's 16-bit parts (quant_matmul.c) get coarser steps in its block
    wf = dequantize(w).double()
    want = x.double() @ wf.T
    # float32 sums of 576 products: their worst case is 576 roundings of 6e-8, but rounding in
    # random directions stays near 1e-7 (seen: 0.8-2.6e-7); 2e-6 still fails one row's 16-bit
    # activations without their low parts (1.9e-5)
    bound = 2e-6 * (x.double().abs() @ wf.abs().T)
    got = matmul(x, w)
    assert got.shape == (rows, 201) and got.dtype == torch.float32
    assert ((got.double() - want).abs() <= bound).all()


@pytest.mark.parametrize("form", ["u4", "i8"])
@pytest.mark.parametrize("rows", [1, 2, 5])
def test_a_nan_in_x_reaches_its_row_of_the_output(form, rows):
    """As in a float32 product: one row's 16-bit integer parts must not turn a NaN into a number."""
    w = _weight(form, 9, 64, seed=2)
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(3))
    x[0, 37] = float("nan")
    out = matmul(x, w)
    assert out[0].isnan().all() and not out[1:].isnan().any()


@pytest.mark.parametrize("form", ["u4", "i8"])
def test_one_row_with_an_inf_or_tiny_values_is_a_float32_product(form):
    """Where 16-bit parts cannot hold a row (an inf: 32767 / max is 0; values below 2^-100:
    32767 / max overflows), one row gives what a float32 product gives: the signed infinities,
    and tiny values within float32 rounding (not one shared wrong value)."""
    w = _weight(form, 9, 64, seed=4)
    wf = dequantize(w).double()
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(5))
    x[0, 3] = float("inf")
    out = matmul(x, w)
    signs = torch.sign(wf[:, 3])
    assert torch.equal(torch.isinf(out[0]), signs != 0) and torch.equal(torch.sign(out[0][signs != 0]), signs[signs != 0].float())
    tiny = torch.randn(1, 64, generator=torch.Generator().manual_seed(6)) * 1e-36
    want = tiny.double() @ wf.T
    assert ((matmul(tiny, w).double() - want).abs() <= 2e-6 * (tiny.double().abs() @ wf.abs().T)).all()


def test_linear_takes_blocks_for_few_rows_and_its_float_weight_beyond():
    from kvos.models import ops

    w = _weight("u4", 96, 256, seed=3)
    layer = ops.Linear(256, 96, bias=True)
    with torch.no_grad():
        layer.weight.copy_(dequantize(w))
        layer.bias.copy_(torch.randn(96))
    layer.attach_blocks(w)
    for rows in (1, 5, ops.BLOCK_WEIGHT_ROWS, ops.BLOCK_WEIGHT_ROWS + 1):
        x = torch.randn(rows, 256)
        with torch.no_grad():
            torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias),
                                       rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="do not match"):
        layer.attach_blocks(_weight("u4", 96, 512, seed=4))


def _paged_cache(num_blocks: int, block_size: int, kv_heads: int, dim: int):
    """K and V as the runner views them: slices of a page-major pool ``[blocks, layers, 2,
    block_size, kv_heads, dim]`` (layer 1 of 2)."""
    pool = torch.randn(num_blocks, 2, 2, block_size, kv_heads, dim)
    return pool[:, 1, 0], pool[:, 1, 1]


@pytest.mark.parametrize("heads,kv_heads,dim,window", [(9, 3, 64, None), (8, 2, 128, 40), (4, 1, 256, 20),
                                                      (2, 2, 32, 7)])
def test_paged_decode_attention_equals_the_torch_reference(heads, kv_heads, dim, window):
    from kvos.kernels.cpu.paged_attention import decode_attention, supports
    from kvos.worker.torch_attention import TorchReferenceBackend

    block_size, lens = 4, [1, 5, 16, 37, 3]
    k, v = _paged_cache(64, block_size, kv_heads, dim)
    g = torch.Generator().manual_seed(0)
    order = torch.randperm(63, generator=g) + 1  # blocks in shuffled order, never the null block
    tables = torch.zeros(len(lens), 10, dtype=torch.int32)
    used = 0
    for i, n in enumerate(lens):
        nb = -(-n // block_size)
        tables[i, :nb] = order[used : used + nb]
        used += nb
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(len(lens), heads, dim, generator=g)
    assert supports(q, k, v)
    scale = dim ** -0.5
    got = decode_attention(q, k, v, tables, seq_lens, scale, window)
    for i, n in enumerate(lens):
        from kvos.models.attention import KVCache

        want = TorchReferenceBackend._decode_group(q[i : i + 1], KVCache(k, v), tables[i : i + 1],
                                                   seq_lens[i : i + 1], n, block_size, scale, window)
        torch.testing.assert_close(got[i : i + 1], want, rtol=1e-5, atol=1e-6)


def test_paged_write_equals_the_torch_reference_write():
    from kvos.kernels.cpu.paged_attention import write_kv
    from kvos.models.attention import KVCache
    from kvos.worker.torch_attention import write_kv as reference_write

    k, v = _paged_cache(8, 4, 2, 32)
    k2, v2 = k.clone(), v.clone()
    kv = torch.randn(5, 3, 2, 32)  # row-strided k and v views, as split from a fused projection
    slots = torch.tensor([7, 0, -1, 31, 12])  # -1: a padding row, never written
    write_kv(kv[:, 0], kv[:, 1], k, v, slots)
    keep = slots >= 0
    reference_write(kv[keep, 0], kv[keep, 1], KVCache(k2, v2), slots[keep])
    assert torch.equal(k, k2) and torch.equal(v, v2)
    assert torch.equal(k[1, 3], kv[0, 0]) and torch.equal(v[3, 0], kv[4, 1])  # slots 7 and 12


def test_rotary_is_bit_exact_and_norm_within_rounding():
    from kvos.models import ops

    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(7, 5 * 64, generator=g)  # q and k as row-strided views of a fused projection
    q, k = qkv[:, : 3 * 64].view(7, 3, 64), qkv[:, 3 * 64 : 4 * 64].view(7, 1, 64)
    pos = torch.tensor([0, 5, 9, 100, 3, 2, 1])
    cos, sin = torch.randn(200, 64, generator=g), torch.randn(200, 64, generator=g)
    for got, want in zip(ops.rotary(pos, q, k, cos, sin), ops.rotary_reference(pos, q, k, cos, sin)):
        assert torch.equal(got, want)
    x, res, w = torch.randn(5, 576, generator=g), torch.randn(5, 576, generator=g), torch.randn(576, generator=g)
    (out, summed), (ref, ref_summed) = ops.rms_norm(x, w, 1e-5, res), ops.rms_norm_reference(x, w, 1e-5, res)
    assert torch.equal(summed, ref_summed)
    torch.testing.assert_close(out, ref, rtol=2e-6, atol=1e-6)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), ops.rms_norm_reference(x, w, 1e-6), rtol=2e-6, atol=1e-6)


def test_the_default_cpu_engine_runs_on_the_kernels(llm):
    """The parity tests against transformers exercise the kernels: the shared engine multiplies
    blocks and attends through the C decode kernel."""
    from kvos.worker.cpu_attention import CpuBackend

    runner = llm.engine.runner
    model = runner.model
    assert isinstance(runner.backend, CpuBackend)
    assert model.lm_head.blocks is not None and model.lm_head.blocks.form == "i8"
    assert all(layer.mlp.down_proj.blocks is not None and layer.self_attn.qkv_proj.blocks is not None
               for layer in model.layers)
