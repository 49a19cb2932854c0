"""Programmatic dependent launch (Hopper and later): a kernel launched with ``launch_pdl`` is
scheduled while the kernel before it in the stream is still running, and waits on the device
(``griddepcontrol.wait``) until that kernel has finished and its writes are visible. A decode
step of one sequence is ~320 short kernels back to back, so each launch's latency hidden under
the previous kernel is time taken off the step. Inside a CUDA graph the dependency is recorded
as a programmatic edge.

Safety rule: a kernel may be launched with ``launch_args(...)`` only if its first statement is
``wait_for_previous(PDL)``: no global load or store before it, so nothing reads a result before
it is complete or overwrites memory the previous kernel still reads (the caching allocator
hands a freed block to the next allocation in stream order). With ``PDL`` false (the CPU
interpreter, older GPUs, ``KVOS_PDL=0``) it compiles to nothing.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@functools.cache
def _enabled_on(index: int) -> bool:
    return (not triton.knobs.runtime.interpret and os.environ.get("KVOS_PDL", "1") != "0"
            and torch.cuda.get_device_capability(index) >= (9, 0))


def enabled(x: torch.Tensor) -> bool:
    """Whether kernels over ``x`` are launched dependently: a CUDA device of compute capability
    9.0 or later, compiled (not the interpreter), and ``KVOS_PDL`` not ``0`` (read once per
    process and device)."""
    return x.is_cuda and _enabled_on(x.device.index if x.device.index is not None else torch.cuda.current_device())


_ON = {"PDL": True, "launch_pdl": True}
_OFF = {"PDL": False}


def launch_args(x: torch.Tensor) -> dict:
    """The launch keywords for a kernel over ``x`` that starts with ``wait_for_previous(PDL)``
    (a shared dict: unpack it, do not change it)."""
    return _ON if enabled(x) else _OFF


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    """Wait for the previous kernel in the stream (and its memory), then let the next one launch.
    Must come before any global memory access of the kernel."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
