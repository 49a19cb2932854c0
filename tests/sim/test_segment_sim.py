"""Segment reuse in the simulator (the engine's own scheduler): reused tokens counted against an
oracle written here, and the RAG workload's report."""
from __future__ import annotations

import math
import random

from kvos.sim.cost_model import CostModel
from kvos.sim.hardware import GPUS
from kvos.sim.shapes import PRESETS
from kvos.sim.simulator import SimConfig, Simulator
from kvos.sim.traces import TraceRequest, rag

COST = CostModel.for_model(PRESETS["llama-3.1-8b"], GPUS["H100-80G"])
BS = 16


def test_reused_tokens_match_an_oracle():
    """Each prompt: a piece of its own, one of five documents, a question. One request at a time,
    so a document's fill (after its first request) is cached before the next request: a
    document seen before is reused whole but its recomputed head, never one seen first."""
    rng = random.Random(3)
    docs = {d: rng.randrange(40, 200) for d in range(5)}
    trace, seen, expected, fills = [], set(), 0, 0
    for i in range(40):
        d = rng.randrange(5)
        own = rng.randrange(1, 50)
        pieces = [(1000 + i, own), (10 + d, docs[d]), (2000 + i, 20)]
        trace.append(TraceRequest(i * 10.0, sum(n for _, n in pieces), 4, segments=pieces))
        full = docs[d] // BS * BS
        if d in seen and full:
            expected += full - math.ceil(0.25 * full)
        elif full:
            fills += 1
        seen.add(d)
    for share, want in ((0.25, expected), (1.0, 0)):
        cfg = SimConfig.of(block_size=BS, max_num_seqs=1, segment_reuse=True, segment_recompute=share)
        report = Simulator(trace, cfg, COST).run()
        assert report["segment_reused_tokens"] == want
        assert report["segment_fills"] == fills
    plain = Simulator(trace, SimConfig.of(block_size=BS, max_num_seqs=1), COST).run()
    assert plain["token_hit_rate"] == 0 and "segment_hits" not in plain


def test_rag_workload_reuses_most_document_tokens():
    trace = rag(200, rate=20, num_docs=10, doc_len=500, docs_per_prompt=3, question_len=(20, 40),
                output_len=(4, 16), system_prompt_len=100, seed=1)
    plain = Simulator(trace, SimConfig.of(block_size=BS), COST).run()
    seg = Simulator(trace, SimConfig.of(block_size=BS, segment_reuse=True, segment_recompute=0.15), COST).run()
    assert seg["segment_fills"] <= 10
    assert seg["token_hit_rate"] > 0.6 > plain["token_hit_rate"]
    assert seg["ttft_p50_s"] < plain["ttft_p50_s"]
