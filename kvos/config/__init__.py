"""Configuration: ``EngineConfig``, the one source of an engine's settings, and the flags generated
from it."""
from kvos.config.engine import EngineConfig

__all__ = ["EngineConfig"]
