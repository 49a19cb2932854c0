"""A configuration value given as a dict or as its JSON text (a CLI flag)."""
from __future__ import annotations

import json


def json_object(value: dict | str, name: str) -> dict:
    """``value`` itself if a dict, else its JSON text parsed; ``ValueError`` naming ``name`` when
    it is not valid JSON or not an object."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, got {type(value).__name__}")
    return value
