"""The ``reuse`` policy: its hit-density estimate against a reuse law known in closed form, and
its hit rate against LRU and the offline optimum where block classes differ (the generic
invariants, never evicting a referenced or pinned block and chain order, are the property tests
every registered policy runs)."""
from __future__ import annotations

import random

import pytest

from kvos.cache.reuse_estimator import _LOWER, _UPPER, HitDensityEstimator, age_bucket
from kvos.sim.cost_model import CostModel
from kvos.sim.hardware import GPUS
from kvos.sim.shapes import PRESETS
from kvos.sim.simulator import SimConfig, Simulator
from kvos.sim.traces import TraceRequest


def test_density_matches_a_known_reuse_law():
    """Class 0: hit with probability 0.8 at ages in [100, 140), else evicted at ages in [2000,
    2800). Class 1: hit with probability 0.1 on the same schedule. The density at age 0 is the
    law's expected hits over expected remaining lifetime, P(hit) / E[age at the end]."""
    rng = random.Random(0)
    est = HitDensityEstimator(2, refresh=10**9, decay=1.0)
    for cls, p in ((0, 0.8), (1, 0.1)):
        for _ in range(20000):
            if rng.random() < p:
                est.record_hit(cls, rng.uniform(100, 140))
            else:
                est.record_eviction(cls, rng.uniform(2000, 2800))
    est.rebuild()
    for cls, p in ((0, 0.8), (1, 0.1)):
        hit_end = _UPPER[age_bucket(120)]  # the estimator counts a bucket's events at its upper age
        evict_end = sum(_UPPER[age_bucket(a)] for a in range(2000, 2800)) / 800
        expected = p / (p * hit_end + (1 - p) * evict_end)
        assert est.density(cls, 0) == pytest.approx(expected, rel=0.05)
        # past the hits only evictions remain: nearly worthless
        assert est.density(cls, 500) < 0.01 * est.density(cls, 0)
    assert est.density(0, 0) > 5 * est.density(1, 0)


def test_a_class_without_observations_borrows_the_prior():
    est = HitDensityEstimator(3, refresh=10**9, decay=1.0)
    for _ in range(100):
        est.record_hit(0, 10)
        est.record_eviction(1, 10)
    est.rebuild()
    assert est.density(2, 5) == pytest.approx(
        (100 + 0.01) / (200 * _UPPER[age_bucket(10)] - 200 * _LOWER[age_bucket(5)] + 201), rel=1e-9)
    assert est.density(0, 5) > est.density(2, 5) > est.density(1, 5)


def test_decay_follows_a_changed_workload():
    est = HitDensityEstimator(1, refresh=100, decay=0.5)
    for _ in range(1000):
        est.record_hit(0, 10)
    high = est.density(0, 0)
    for _ in range(1000):
        est.record_eviction(0, 10)
    assert est.density(0, 0) < 0.01 * high


COST = CostModel.for_model(PRESETS["llama-3.1-8b"], GPUS["H100-80G"])


def _hit_rate(trace: list[TraceRequest], policy: str, num_blocks: int) -> float:
    cfg = SimConfig.of(block_size=16, num_blocks=num_blocks, eviction_policy=policy, max_num_seqs=1,
                       max_num_batched_tokens=2048, eviction_lookahead=0)
    return Simulator(trace, cfg, COST).run()["token_hit_rate"]


@pytest.mark.parametrize("num_blocks", [60, 120])
def test_learns_that_generated_blocks_are_not_reused(num_blocks):
    """Documents with Zipf popularity, each answered at length: no later prompt repeats an
    answer, so the answers' blocks are dead weight that LRU keeps as long as the documents. The
    policy learns it online and closes a third of the LRU-to-optimum gap or more (one sequence at
    a time, where the optimum is an upper bound)."""
    rng = random.Random(1)
    weights = [1 / (i + 1) for i in range(60)]
    trace = [TraceRequest(i * 0.01, 64, 96, segments=[(rng.choices(range(60), weights)[0] + 1, 64)])
             for i in range(300)]
    lru, reuse, best = (_hit_rate(trace, p, num_blocks) for p in ("lru", "reuse", "belady"))
    assert lru < reuse <= best
    assert (reuse - lru) / (best - lru) >= 1 / 3, (lru, reuse, best)
