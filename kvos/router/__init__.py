"""Routing requests across several engines (pure Python: the fleet simulator and a multi-engine
front end use the same policies). Routers are chosen by name from ``ROUTERS``
(``register_router``); ``RouterConfig`` holds the settings."""
from kvos.core.load import EngineLoad
from kvos.router.config import RouterConfig
from kvos.router.policies import (
    ROUTERS,
    Approx,
    KVAware,
    LeastLoaded,
    RoundRobin,
    Router,
    make_router,
    register_router,
)

__all__ = ["ROUTERS", "Approx", "EngineLoad", "KVAware", "LeastLoaded", "RoundRobin", "Router", "RouterConfig",
           "make_router", "register_router"]
