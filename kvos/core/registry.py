"""Named classes chosen by a setting: a policy registry. Pure Python."""
from __future__ import annotations

from typing import Generic, TypeVar

T = TypeVar("T", bound=type)


class Registry(dict[str, T], Generic[T]):
    """``name -> class`` for one kind of policy (eviction, waiting queue, victim order, router).

    ``register`` is the class decorator that adds a class under its ``name`` attribute; a name is
    registered once. Registration order is kept (it is the CLI's order of choices)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def register(self, cls: T) -> T:
        name = cls.name
        if name in self:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self[name] = cls
        return cls
