"""``SimOptions``: the simulator's own knobs (its engine settings are ``EngineConfig``'s)."""
from __future__ import annotations

from dataclasses import dataclass, field

ALLOCATORS = ("paged", "contiguous")


@dataclass
class SimOptions:
    """The simulator's own knobs; its engine settings are an ``EngineConfig``'s (``SimConfig``).
    Field metadata drives the ``kvos simulate`` flags (``kvos.config.flags.add_config_args``)."""

    allocator: str = field(default="paged", metadata={
        "choices": ALLOCATORS,
        "help": "paged: the engine's block pool; contiguous: each request reserves --max-model-len slots up front "
                "(early systems; needs --kv-layout homogeneous for a hybrid --model)"})
    time_scale: float = field(default=1.0, metadata={"help": "multiply arrival times (2 = half the rate)"})

    def __post_init__(self) -> None:
        if self.allocator not in ALLOCATORS:
            raise ValueError(f"allocator must be 'paged' or 'contiguous', got {self.allocator!r}")
        if self.time_scale <= 0:
            raise ValueError(f"time_scale must be > 0, got {self.time_scale}")
