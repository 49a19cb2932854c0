"""Block rows shared between processes of one host by CUDA IPC (the hand-over of disaggregated
prefill): a prefill engine's ranks share, a decode engine's ranks copy."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class DeviceRows:
    """Rows on a GPU of the process that made them, shared by CUDA IPC (torch's handle).

    Safety: the sender's torch keeps the memory alive until the receiver's opened tensor is
    freed (a reference counter in shared memory), so the sender may drop its own reference at
    once. Open it at most once, in one process of the same host that sees the sender's GPU.
    A handle that is never opened keeps its memory until the sender exits."""

    rebuild: Callable[..., Any]
    args: tuple
    nbytes: int

    @classmethod
    def share(cls, rows) -> DeviceRows:
        from torch.multiprocessing.reductions import reduce_tensor

        rebuild, args = reduce_tensor(rows)
        return cls(rebuild, args, rows.numel() * rows.element_size())

    def open(self):
        """The rows as a tensor of this process (the sender's memory, mapped; reads wait for
        the sender's gather through an IPC event)."""
        return self.rebuild(*self.args)


@dataclass
class RankRows:
    """A tensor-parallel engine's rows: ``parts[r]`` holds rank r's part of every block (its K/V
    heads), on rank r's GPU. Only a receiver of the same tensor-parallel size can use them, each
    of its ranks opening its own part (``ModelRunner.write_shared_rows``); ``open`` therefore
    opens nothing."""

    parts: list[DeviceRows]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def open(self) -> RankRows:
        return self
