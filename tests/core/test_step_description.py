"""The runner runs a step from plain data: the description crosses a pickle boundary that admits
only its own classes, and the outputs equal the in-process engine's, token for token."""
from __future__ import annotations

import io
import pickle

import pytest

from kvos import SamplingParams
from kvos.core.step import StepDescription

ALLOWED = {("kvos.core.step", "StepDescription"), ("kvos.core.step", "StepSeq"),
           ("kvos.core.step", "SampleTarget"), ("kvos.core.sampling_params", "SamplingParams")}


class PlainDataUnpickler(pickle.Unpickler):
    """Refuses every class but the description's own: no request, block or tensor can ride along."""

    def find_class(self, module: str, name: str):
        if (module, name) not in ALLOWED:
            raise pickle.UnpicklingError(f"{module}.{name} is not plain step data")
        return super().find_class(module, name)


class OverTheWire:
    """Hands the runner each step as another process would receive it (pickled and rebuilt)."""

    def __init__(self, runner) -> None:
        self._runner = runner
        self.steps = 0

    def launch(self, step: StepDescription, **kw):
        data = pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL)
        self.steps += 1
        return self._runner.launch(PlainDataUnpickler(io.BytesIO(data)).load(), **kw)

    def __getattr__(self, name: str):
        return getattr(self._runner, name)


def test_unpickler_refuses_live_objects():
    from kvos.cache.block import KVBlock

    with pytest.raises(pickle.UnpicklingError, match="KVBlock"):
        PlainDataUnpickler(io.BytesIO(pickle.dumps([KVBlock(3)]))).load()


def test_steps_as_plain_data_give_identical_outputs(make_llm):
    """Greedy and seeded sampling, n=2 forks (copy-on-write), penalties with history,
    min_tokens bans, prompt logprobs and prefix hits, in one batch and the next."""
    shared = "The kernel maps virtual pages to physical frames through page tables. " * 4
    prompts = [shared + "Explain the TLB.", shared + "Explain swapping.", "Count: one, two, three,",
               "Write a haiku about memory."]
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0.9, top_k=40, seed=7, n=2, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0.7, seed=3, repetition_penalty=1.3, presence_penalty=0.5,
                             frequency_penalty=0.4, min_tokens=6, max_tokens=10),
              SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=2, logprobs=2, ignore_eos=True)]

    def run(wire: bool):
        llm = make_llm(num_blocks=64, max_num_batched_tokens=48)  # chunked prefills too
        if wire:
            llm.engine.runner = OverTheWire(llm.engine.runner)
        outs = [llm.generate(prompts, params, use_tqdm=False) for _ in range(2)]  # the second hits
        hits = [o.num_cached_tokens for o in outs[1]]
        return llm, hits, [[(c.token_ids, c.logprobs) for c in o.outputs] + [o.prompt_logprobs]
                           for batch in outs for o in batch]

    _, _, local = run(False)
    llm, hits, remote = run(True)
    assert remote == local
    assert llm.engine.runner.steps > 10 and hits[0] > 0 and hits[1] > 0


def test_an_engine_collects_young_garbage_less_often(llm):
    """An engine raises the collector's young-generation threshold (``relax_gc_thresholds``):
    at CPython's default of 700 the per-step containers were collected many times per step."""
    import gc

    from kvos.engine.gc_tuning import GEN0_THRESHOLD

    assert llm is not None and gc.get_threshold()[0] >= GEN0_THRESHOLD > 700


def test_device_auto_is_the_gpu_torch_sees_else_the_cpu(llm):
    """``--device auto`` (the default) is ``cuda`` where torch sees a GPU, else ``cpu``; other
    names pass through. The shared engine was built with the default."""
    import torch

    from kvos.config import EngineConfig
    from kvos.worker.device import resolve_device

    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert EngineConfig().device == "auto" and resolve_device("auto") == expected
    assert resolve_device("cpu") == "cpu" and resolve_device("cuda:1") == "cuda:1"
    assert llm.engine.runner.device.type == expected
