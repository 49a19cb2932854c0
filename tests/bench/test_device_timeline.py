"""The profile reader of ``kvos bench tier-bandwidth --phases``: the busy time of overlapping
device intervals against a brute-force count, and a profiled call on the CPU (no device events)."""
from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from kvos.bench.device_timeline import _busy, device_timeline

spans = st.lists(st.tuples(st.integers(0, 60), st.integers(0, 20)).map(lambda t: (t[0], t[0] + t[1])), max_size=12)


@given(spans)
def test_busy_time_is_the_union_of_the_intervals(intervals):
    covered = {t for s, e in intervals for t in range(s, e)}  # unit cells [t, t + 1)
    assert _busy([(float(s), float(e)) for s, e in intervals]) == len(covered)


def test_a_profiled_cpu_call_reports_its_wall_time_and_no_copies():
    out = device_timeline(lambda: torch.ones(256, 256) @ torch.ones(256, 256))
    assert out["wall_ms"] > 0 and out["h2d_copies"] == 0
