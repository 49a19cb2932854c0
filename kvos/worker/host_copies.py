"""Host-to-device copies that never wait for the work queued on the device."""
from __future__ import annotations

import warnings

import torch


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list or array on ``device`` without a synchronising copy: on a GPU it goes
    through page-locked memory (torch's caching host allocator keeps the buffer until the copy
    has run), so it is safe while earlier steps are still queued."""
    t = torch.as_tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def as_words(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` (``uint8 [n, nbytes]``, each row contiguous) viewed as 64-bit words when every row
    is whole words (otherwise unchanged): the same memory, for gathers and scatters of whole
    block rows, which move eight bytes per element instead of one (an index copy of uint8 rows
    ran at a fraction of the device's copy bandwidth on the H100)."""
    if rows.shape[-1] % 8 or any(s % 8 for s in rows.stride()[:-1]) or rows.storage_offset() % 8:
        return rows
    return rows.view(torch.int64)


def as_tensor(data) -> torch.Tensor:
    """A uint8 tensor aliasing ``data`` (bytes, a memoryview, any buffer; no copy). Read-only
    buffers (bytes from the disk or Redis tier, a read-only memmap) are only ever read through it."""
    if isinstance(data, memoryview) and not data.readonly:  # e.g. a CPU-tier slot
        return torch.frombuffer(data, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "buffer is not writable"
        return torch.frombuffer(data, dtype=torch.uint8)
