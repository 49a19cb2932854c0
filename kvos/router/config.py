"""``RouterConfig``: a fleet's router settings, the one source of the ``--router``,
``--kv-weight``, ``--router-balance``, ``--router-queue-weight``, ``--router-shared-balance``,
``--router-shared-threshold`` and ``--router-sole-margin`` flags (``kvos.config.flags.add_config_args``)."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from kvos.router.policies import (
    DEFAULT_BALANCE,
    DEFAULT_BALANCE_ABS,
    DEFAULT_BALANCE_REL,
    DEFAULT_KV_WEIGHT,
    DEFAULT_QUEUE_WEIGHT,
    DEFAULT_SHARED_BALANCE,
    DEFAULT_SHARED_THRESHOLD,
    DEFAULT_SOLE_MARGIN,
    ROUTERS,
    Router,
    balance_error,
    make_router,
)


def parse_balance(text: str) -> tuple[int, float]:
    """``ABS,REL`` (or ``ABS REL``) as the balance guard's ``(int, float)``; an argparse type."""
    parts = text.replace(",", " ").split()
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"give ABS,REL (e.g. 8,2), got {text!r}")
    try:
        abs_, rel = int(parts[0]), float(parts[1])
    except ValueError:
        raise argparse.ArgumentTypeError(f"give ABS,REL as an integer and a number, got {text!r}") from None
    if (err := balance_error(abs_, rel)) is not None:
        raise argparse.ArgumentTypeError(err)
    return abs_, rel


ROUTER_FLAGS = "router (several engines)"  # the CLI's argument group for these fields


@dataclass
class RouterConfig:
    """Which router spreads requests over a fleet's engines, and its settings. ``kv_weight``,
    ``router_balance``, ``router_queue_weight``, ``router_shared_balance``,
    ``router_shared_threshold`` and ``router_sole_margin`` apply to kv_aware and approx
    (``kvos.router.policies.KVAware``)."""

    router: str = field(default="kv_aware", metadata={
        "choices": ROUTERS, "group": ROUTER_FLAGS,
        "help": "kv_aware: the engine already holding most of the prompt's prefix (from its KV events), weighed "
                "against its load; approx: the same from the router's own record, no events"})
    kv_weight: float = field(default=DEFAULT_KV_WEIGHT, metadata={
        "group": ROUTER_FLAGS,
        "help": "kv_aware/approx: weight of the prefill an engine would do (prompt blocks it lacks plus "
                "--router-queue-weight times its queued prefill) against its active decode blocks"})
    router_balance: tuple[int, float] = field(default=DEFAULT_BALANCE, metadata={
        "type": parse_balance, "metavar": "ABS,REL", "group": ROUTER_FLAGS,
        "help": "kv_aware/approx balance guard: an engine with more than ABS requests over the least loaded one "
                f"and over REL times its count is not chosen (default {DEFAULT_BALANCE_ABS},"
                f"{DEFAULT_BALANCE_REL:g}; REL 0: off)"})
    router_queue_weight: float = field(default=DEFAULT_QUEUE_WEIGHT, metadata={
        "group": ROUTER_FLAGS,
        "help": "kv_aware/approx: what a block of an engine's queued prefill costs against a block of the request's "
                f"own (lower: a request stays with its cached prefix behind a longer queue; default "
                f"{DEFAULT_QUEUE_WEIGHT:g}; Dynamo's is 1)"})
    router_shared_balance: tuple[int, float] = field(default=DEFAULT_SHARED_BALANCE, metadata={
        "type": parse_balance, "metavar": "ABS,REL", "group": ROUTER_FLAGS,
        "help": "kv_aware/approx second balance guard, for shared prefixes: an engine over it (same rule as "
                "--router-balance) is not chosen where the request's cached prefix there is shared (see "
                f"--router-shared-threshold) (default {DEFAULT_SHARED_BALANCE[0]},{DEFAULT_SHARED_BALANCE[1]:g})"})
    router_shared_threshold: int = field(default=DEFAULT_SHARED_THRESHOLD, metadata={
        "metavar": "T", "group": ROUTER_FLAGS,
        "help": "kv_aware/approx: a request's cached prefix on an engine is shared when its last block was in more "
                "than T earlier requests (a hot system prompt); such an engine must pass --router-shared-balance "
                f"too (default {DEFAULT_SHARED_THRESHOLD}; 0: off)"})
    router_sole_margin: int = field(default=DEFAULT_SOLE_MARGIN, metadata={
        "metavar": "M", "group": ROUTER_FLAGS,
        "help": "kv_aware/approx: an engine holding at least M more of the prompt's leading blocks than every other "
                "is chosen whatever its queue, if both balance guards allow it (a conversation stays with its "
                f"history; default {DEFAULT_SOLE_MARGIN}; 0: off)"})

    def __post_init__(self) -> None:
        if self.router not in ROUTERS:
            raise ValueError(f"router must be one of {', '.join(ROUTERS)}, got {self.router!r}")
        if self.kv_weight < 0:
            raise ValueError(f"kv_weight must be >= 0, got {self.kv_weight}")
        if (err := balance_error(*self.router_balance)) is not None:
            raise ValueError(f"router_balance: {err}")
        if self.router_queue_weight < 0:
            raise ValueError(f"router_queue_weight must be >= 0, got {self.router_queue_weight}")
        if (err := balance_error(*self.router_shared_balance)) is not None:
            raise ValueError(f"router_shared_balance: {err}")
        if self.router_shared_threshold < 0:
            raise ValueError(f"router_shared_threshold must be >= 0 (0: off), got {self.router_shared_threshold}")
        if self.router_sole_margin < 0:
            raise ValueError(f"router_sole_margin must be >= 0 (0: off), got {self.router_sole_margin}")

    def build(self, num_engines: int, block_size: int = 16, capacity_blocks: int = 2000) -> Router:
        """The router for ``num_engines`` engines of ``block_size``-token blocks of which each
        holds ``capacity_blocks`` (what approx remembers per engine; the shared-prefix guard
        counts uses of that many blocks per engine)."""
        return make_router(self.router, num_engines, block_size, capacity_blocks, overlap_weight=self.kv_weight,
                           queue_weight=self.router_queue_weight, balance=self.router_balance,
                           shared_balance=self.router_shared_balance, shared_threshold=self.router_shared_threshold,
                           sole_margin=self.router_sole_margin)
