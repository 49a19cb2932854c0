"""kvos's GGUF dequantization equals gguf's reference bit for bit, for the fast formats and the
fallback."""
from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0", "Q4_K", "F16"])
def test_dequantize_equals_gguf_reference(qtype):
    from gguf.quants import dequantize as reference
    from gguf.quants import quantize

    from kvos.models.gguf_dequant import dequantize

    t = gguf.GGMLQuantizationType[qtype]
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((48, 512)) * rng.uniform(0.01, 10, (48, 1)) + rng.uniform(-1, 1, (48, 1)))
    try:
        raw = quantize(x.astype(np.float32), t)
    except NotImplementedError:  # gguf cannot quantize every format: take its bytes at random
        raw = rng.integers(0, 256, (48, 512 // 256 * gguf.GGML_QUANT_SIZES[t][1]), dtype=np.uint8)
    out = dequantize(raw, t)
    ref = np.array(reference(raw, t), dtype=np.float32)
    assert out.dtype == np.float32 and out.shape == ref.shape == (48, 512)
    assert np.array_equal(out, ref, equal_nan=True)
