"""Page-locked host memory for the CPU tier's slots when the engine runs on a GPU."""
from __future__ import annotations

import torch


class PageLockedAllocator:
    """An ``allocate(nbytes) -> memoryview`` for ``SlotArena``: each call pins a new
    ``torch.uint8`` tensor and returns a view of its memory. The tensors are kept here for the
    allocator's lifetime (the memoryview's numpy base also references its tensor), so the views
    never dangle. ``torch.frombuffer`` over such a view aliases the pinned tensor: the CUDA
    driver sees page-locked memory and DMAs from it directly, asynchronously on a stream."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []

    def __call__(self, nbytes: int) -> memoryview:
        t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self.tensors.append(t)
        return memoryview(t.numpy())
