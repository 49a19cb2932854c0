"""What a request's output must match, mirroring vLLM's ``StructuredOutputsParams``. Pure Python.

Exactly one constraint is set: ``json`` (a JSON schema, as a dict or its JSON text),
``json_object`` (any JSON object), ``regex``, ``choice`` (one of these strings) or ``grammar``
(a Lark grammar, or llama.cpp's GBNF). ``whitespace_flexible`` lets JSON hold free whitespace
(by default it is compact, which keeps small models from rambling in blanks). The grammar is
compiled and checked against the model's tokenizer by the engine (``kvos.structured``); here
only the shape is checked. Errors name the field: ``structured_outputs.<key>``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    whitespace_flexible: bool = False
    field_name: str = "structured_outputs"
    """How errors name this constraint (the API field it came from: ``response_format``,
    ``guided_json``, ``tool_choice``, ...)."""

    def __post_init__(self) -> None:
        if self.choice is not None and not isinstance(self.choice, tuple):
            object.__setattr__(self, "choice", tuple(self.choice) if isinstance(self.choice, list) else self.choice)
        self.validate()

    @property
    def kind(self) -> str:
        """The one constraint set: ``json``, ``json_object``, ``regex``, ``choice`` or ``grammar``."""
        return next(k for k in _KINDS if self._is_set(k))

    def _is_set(self, kind: str) -> bool:
        value = getattr(self, kind)
        return value is True if kind == "json_object" else value is not None

    def validate(self) -> None:
        name = self.field_name
        given = [k for k in _KINDS if self._is_set(k)]
        if len(given) != 1:
            raise ValueError(f"{name}: set exactly one of {', '.join(_KINDS)}, got "
                             f"{', '.join(given) if given else 'none'}")
        if not isinstance(self.whitespace_flexible, bool):
            raise ValueError(f"{name}.whitespace_flexible must be true or false")
        kind = given[0]
        value = getattr(self, kind)
        if kind == "json":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError as e:
                    raise ValueError(f"{name}.json: not valid JSON ({e})") from None
            if not isinstance(value, (dict, bool)):
                raise ValueError(f"{name}.json must be a JSON schema (an object), got {type(value).__name__}")
        elif kind in ("regex", "grammar"):
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name}.{kind} must be a non-empty string")
        elif kind == "choice":
            if (not isinstance(value, tuple) or not value
                    or any(not isinstance(c, str) or not c for c in value)):
                raise ValueError(f"{name}.choice must be a non-empty list of non-empty strings")

    def cache_key(self) -> tuple:
        """Equal for constraints that compile to the same grammar."""
        kind = self.kind
        value = getattr(self, kind)
        if kind == "json" and not isinstance(value, str):
            value = json.dumps(value, sort_keys=True)
        return kind, value, self.whitespace_flexible
