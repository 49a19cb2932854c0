"""Shared fixtures: one default-model engine and one transformers reference per session."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


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
