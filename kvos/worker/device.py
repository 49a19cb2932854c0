"""Which torch device an engine runs on."""
from __future__ import annotations


def resolve_device(device: str) -> str:
    """``auto`` as the device it means here: ``cuda`` when torch sees a GPU, else ``cpu``;
    any other name unchanged."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
