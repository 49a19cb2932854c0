"""Images in the simulator (the engine's scheduler, KV manager and encoder group, a cost model in
place of the model): requests sharing a few images behind texts of their own run each image
through the encoder once with the encoder cache and once per request without it, whose time
shows in TTFT; a cache too small for every image evicts and encodes again."""
from __future__ import annotations

import pytest

from kvos.sim.cost_model import CostModel
from kvos.sim.hardware import resolve_gpu
from kvos.sim.shapes import resolve_shape
from kvos.sim.simulator import SimConfig, Simulator
from kvos.sim.traces import images

SHAPE = resolve_shape("gemma-3-12b")
COST = CostModel.for_model(SHAPE, resolve_gpu("H200"))


def simulate(trace, **engine) -> dict:
    return Simulator(trace, SimConfig.of(block_size=16, **engine), COST).run()


def test_shared_images_are_encoded_once_with_the_encoder_cache():
    trace = images(60, rate=0.5, num_images=5, image_tokens=SHAPE.vision.tokens_per_image, prefix_len=(8, 32),
                   question_len=(8, 32), output_len=(4, 8), seed=1)
    used = {img for r in trace for _, _, img in r.images}
    cached = simulate(trace)
    plain = simulate(trace, encoder_cache_mb=0)
    assert cached["encoder_runs"] == len(used) and cached["encoder_cache_hits"] == len(trace) - len(used)
    assert plain["encoder_runs"] == len(trace)  # one request at a time: each encodes its image
    assert plain["encoder_seconds"] == pytest.approx(len(trace) * COST.encoder_s_per_image) and COST.encoder_s_per_image > 0
    assert cached["ttft_mean_s"] < plain["ttft_mean_s"]
    # the text before each image differs: no image block is ever a prefix hit
    assert cached["token_hit_rate"] == plain["token_hit_rate"] == 0.0


def test_a_small_encoder_cache_evicts_and_encodes_again():
    trace = images(40, rate=0.5, num_images=4, image_tokens=SHAPE.vision.tokens_per_image, prefix_len=(8, 32),
                   question_len=(8, 32), output_len=(4, 8), seed=2)
    one = COST.encoding_bytes / (1 << 20)  # room for one encoding (in the simulated pool's scale)
    r = simulate(trace, encoder_cache_mb=one)
    assert r["encoder_cache_evictions"] > 0
    assert len({img for t in trace for _, _, img in t.images}) < r["encoder_runs"] < len(trace)
