"""Routing requests across several engines (pure Python: the fleet simulator and a multi-engine
front end use the same policies)."""
from kvos.core.load import EngineLoad
from kvos.router.policies import (
                                  ROUTERS,
                                  Approx,
                                  KVAware,
                                  LeastLoaded,
                                  RoundRobin,
                                  Router,
                                  make_router,
)

__all__ = ["ROUTERS", "Approx", "EngineLoad", "KVAware", "LeastLoaded", "RoundRobin", "Router", "make_router"]
