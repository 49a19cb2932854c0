"""Joining a Ray cluster and placing engines on it.

Placement: the engines a front end starts together get one placement group with a bundle per
engine, spread over the cluster's nodes (``SPREAD``: distinct nodes while there are enough). A
bundle lives on one node, so an engine's tensor-parallel ranks, which it starts as processes of
its own, share a host and the bundle's GPUs. An engine added later gets a group of its own. A
restarted actor returns to its bundle.

Joining: Ray 2.59 and later start clusters with token authentication, but a client that names
the cluster's address only sends a token when ``RAY_AUTH_MODE=token`` is set (``address="auto"``
finds it through the session). ``join`` sets it whenever a token is at hand (``RAY_AUTH_TOKEN``,
``RAY_AUTH_TOKEN_PATH``, or the ``~/.ray/auth_token`` that ``ray start`` writes) and says what to
do when the cluster refuses.
"""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

log = logging.getLogger("kvos.distributed")

PLACEMENT_TIMEOUT_S = 120.0
"""How long engines wait for the cluster to hold their bundles before the start fails."""

BUNDLE_CPUS = 0.01
"""CPU a bundle reserves: a token share, so that placement (one host per engine's ranks, engines
spread over hosts) never refuses engines on a cluster with fewer CPUs than engines; an engine's
torch threads are set from the cluster's CPUs, not from this."""


def ray_token_at_hand() -> bool:
    """A Ray auth token this process would send: in the environment or ``ray start``'s file."""
    if os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH"):
        return True
    return (Path.home() / ".ray" / "auth_token").is_file()


def _token_mode() -> None:
    """``RAY_AUTH_MODE=token`` for this process and its children; Ray caches its config at import,
    so it is refreshed (Ray's own helper where it has one)."""
    try:
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )
    except ImportError:  # another Ray: the variable alone (read when Ray starts its config)
        os.environ["RAY_AUTH_MODE"] = "token"
        return
    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


def join(address: str | None, env_vars: dict[str, str]) -> bool:
    """``ray.init`` for ``address`` (None: ``RAY_ADDRESS``'s cluster, the one ``ray start`` last
    started here, or a new local one; ``"local"``: a new local one). Returns True when this call
    started Ray in this process (the caller shuts it down). A refused join raises
    ``ConnectionError`` naming the token settings."""
    import ray

    if ray.is_initialized():
        return False
    if address not in (None, "local", "auto") and "RAY_AUTH_MODE" not in os.environ and ray_token_at_hand():
        _token_mode()
    try:
        ray.init(address=address, include_dashboard=False, log_to_driver=True, runtime_env={"env_vars": env_vars})
    except ConnectionError as err:
        raise ConnectionError(
            f"ray_address {address!r}: could not join the cluster ({err}). A cluster started by `ray start` "
            f"(Ray >= 2.59) wants its token: on the head, `ray get-auth-token`; here, RAY_AUTH_TOKEN=<token> "
            f"or RAY_AUTH_TOKEN_PATH=<file>, with RAY_AUTH_MODE=token") from err
    return True


def engine_bundle(gpus: int) -> dict[str, float]:
    """One engine's resources: ``gpus`` GPUs (its tensor-parallel ranks; 0 on the CPU) and a
    token CPU share, all on one node."""
    return {"CPU": BUNDLE_CPUS, **({"GPU": float(gpus)} if gpus else {})}


def place_engines(n: int, gpus: int, strategy: str = "SPREAD"):
    """A ready placement group of ``n`` engine bundles (``engine_bundle(gpus)``). Raises
    ``RuntimeError`` naming the resources when the cluster cannot hold them in time."""
    import ray
    from ray.exceptions import GetTimeoutError
    from ray.util.placement_group import placement_group, remove_placement_group

    pg = placement_group([engine_bundle(gpus)] * n, strategy=strategy)
    try:
        ray.get(pg.ready(), timeout=PLACEMENT_TIMEOUT_S)
    except GetTimeoutError:
        remove_placement_group(pg)
        raise RuntimeError(f"placement: the Ray cluster could not hold {n} engine(s) of {gpus} GPU(s) each "
                           f"within {PLACEMENT_TIMEOUT_S:.0f} s (cluster: {ray.cluster_resources()})") from None
    return pg


def in_bundle(pg, index: int):
    """The scheduling strategy that puts an actor (and what it starts) in bundle ``index``."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=index,
                                            placement_group_capture_child_tasks=True)


def remove(pg) -> None:
    from ray.util.placement_group import remove_placement_group

    remove_placement_group(pg)


def where_am_i() -> dict:
    """This process's place: host name, Ray node id (None outside Ray), visible GPUs."""
    import socket

    ray = sys.modules.get("ray")  # a Ray worker has it imported; a plain engine process need not import it
    node = ray.get_runtime_context().get_node_id() if ray is not None and ray.is_initialized() else None
    return {"host": socket.gethostname(), "node": node, "pid": os.getpid(),
            "gpus": os.environ.get("CUDA_VISIBLE_DEVICES")}
