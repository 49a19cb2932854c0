"""Engine outputs as deltas (``kvos.distributed.output_delta``): the front end's rebuilt output
equals the engine's cumulative one after every poll, whichever outputs the polls coalesced."""
from __future__ import annotations

import pickle

from hypothesis import given, settings
from hypothesis import strategies as st

from kvos.core.outputs import CompletionOutput, RequestOutput
from kvos.distributed.output_delta import DeltaEncoder, OutputAccumulator


def cumulative(step: int, n: int, logprobs: bool, finished: bool) -> RequestOutput:
    """The engine's output after ``step`` tokens of each of ``n`` completions."""
    comps = [CompletionOutput(i, "".join(f"t{i}.{k} " for k in range(step)), [100 * i + k for k in range(step)],
                              -0.5 * step if logprobs else None,
                              [{100 * i + k: -0.5} for k in range(step)] if logprobs else None,
                              ("length" if finished else None), None) for i in range(n)]
    return RequestOutput("r", None, [], comps, finished, num_cached_tokens=16,
                         metrics={"arrival_time": 1.0, "first_token_time": 2.0 if step else None,
                                  **({"finished_time": 3.0} if finished else {})},
                         prompt_logprobs=[None, {5: -1.0}] if logprobs else None)


@settings(max_examples=60, deadline=None)
@given(steps=st.integers(1, 12), n=st.integers(1, 3), logprobs=st.booleans(), data=st.data())
def test_rebuilt_output_equals_the_cumulative_one_after_every_poll(steps, n, logprobs, data):
    enc = DeltaEncoder()
    acc = OutputAccumulator("the prompt", [5, 6])
    snapshots = []
    for step in range(1, steps + 1):
        out = cumulative(step, n, logprobs, step == steps)
        if step < steps and data.draw(st.booleans()):
            continue  # coalesced: the next poll carries this step's tokens too
        delta = pickle.loads(pickle.dumps(enc.encode(out)))  # as it crosses the process boundary
        got = acc.apply(delta)
        snapshots.append((got, out))
        assert got.prompt == "the prompt" and got.prompt_token_ids == [5, 6]
        assert (got.outputs, got.finished, got.num_cached_tokens, got.metrics, got.prompt_logprobs) == \
               (out.outputs, out.finished, out.num_cached_tokens, out.metrics, out.prompt_logprobs)
    for got, out in snapshots:  # earlier snapshots were not changed by later deltas
        assert got.outputs == out.outputs
    assert len(enc) == 0  # the finished request is forgotten


def test_a_delta_carries_only_the_new_tokens():
    enc = DeltaEncoder()
    enc.encode(cumulative(100, 1, False, False))
    delta = enc.encode(cumulative(101, 1, False, False))
    assert delta[5][0][1] == [100] and delta[5][0][2] == "t0.100 " and delta[3] is None  # metrics unchanged
    enc.forget("r")
    assert len(enc) == 0
