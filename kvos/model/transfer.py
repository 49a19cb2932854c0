"""Host-to-device copies that never wait for the work queued on the device."""
from __future__ import annotations

import torch


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list or array on ``device`` without a synchronising copy: on a GPU it goes
    through page-locked memory (torch's caching host allocator keeps the buffer until the copy
    has run), so it is safe while earlier steps are still queued."""
    t = torch.as_tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
