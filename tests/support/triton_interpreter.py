"""Triton kernels on CPU tensors when there is no GPU: import this before anything imports triton.

``triton.jit`` reads ``TRITON_INTERPRET`` when it decorates a function, and triton decorates its own
helpers (``tl.cdiv``, ...) when it is first imported, so the flag is set here, at import, without
a GPU (``setdefault``: an explicit ``TRITON_INTERPRET=0`` still wins, and then the kernel tests skip).
"""
from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def skip_unless_interpreted(*kernels) -> None:
    """Without a GPU, skip the calling test module unless triton's helpers and ``kernels`` really
    run in the interpreter (triton or kvos.kernels may have been imported before the flag)."""
    if CUDA:
        return
    import triton
    from triton.runtime.interpreter import InterpretedFunction

    if not (INTERPRET and isinstance(triton.language.standard.cdiv, InterpretedFunction)
            and all(isinstance(k, InterpretedFunction) for k in kernels)):
        pytest.skip("no CUDA GPU, and triton (or kvos.kernels) was imported before "
                    "TRITON_INTERPRET=1 was set: run with TRITON_INTERPRET=1 in the environment",
                    allow_module_level=True)
