"""Request sampling defaults: which keys a generation config may set, and the operator's override."""
from __future__ import annotations

from kvos.core.json_object import json_object
from kvos.core.sampling_params import SamplingParams

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
"""The generation-config keys that become request defaults (HF's names, kvos's fields)."""

GENERATION_CONFIGS = ("auto", "kvos")
"""auto: the model's recommended values (``kvos.models.generation_defaults``); kvos: none (a request's
unset fields take ``SamplingParams``' defaults)."""


def parse_override(value: dict | str | None) -> dict[str, float]:
    """``override_generation_config``: a dict or its JSON, keys from ``SAMPLING_KEYS``, values a
    ``SamplingParams`` accepts; ``ValueError`` naming the key otherwise."""
    if value is None:
        return {}
    value = json_object(value, "override_generation_config")
    for k in value:
        if k not in SAMPLING_KEYS:
            raise ValueError(f"override_generation_config has unknown key {k!r}; known: {list(SAMPLING_KEYS)}")
    try:
        SamplingParams(**value)
    except (ValueError, TypeError) as e:
        raise ValueError(f"override_generation_config.{e}") from None
    return dict(value)
