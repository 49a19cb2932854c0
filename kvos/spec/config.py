"""``SpeculativeConfig``: how an engine speculates, parsed from vLLM's dict shape."""
from __future__ import annotations

from dataclasses import dataclass, fields

from kvos.core.json_object import json_object

METHODS = ("ngram", "draft_model", "self_draft")
"""Proposers: prompt lookup, a separate draft model, the target's own first layers."""


@dataclass(frozen=True)
class SpeculativeConfig:
    """``{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": a,
    "prompt_lookup_max": b}`` (vLLM's keys), plus ``disable_by_batch_size``: with more
    running sequences than this, no step speculates (the verify step's extra tokens would
    cost more throughput than the accepted drafts save; see docs/speculative.md).

    ``ngram``: the draft continues the latest earlier occurrence of the sequence's last ``n``
    tokens, for ``n`` from ``prompt_lookup_max`` down to ``prompt_lookup_min``, in the prompt
    and the output so far.

    ``draft_model`` (``"model": path``): a smaller model with the target's vocabulary proposes
    ``k`` tokens greedily; its KV is a cache group of its own in the target's pool.
    ``self_draft`` (``"num_draft_layers": n``): the target's first ``n`` layers, then its final
    norm and LM head, propose (LayerSkip's early exit); they share the target's KV, since the
    same weights write the same K and V for those layers.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    disable_by_batch_size: int = 32
    model: str | None = None
    """``draft_model``: the draft's GGUF file or HF folder (its tokenizer must be the target's)."""
    num_draft_layers: int | None = None
    """``self_draft``: how many of the target's first layers draft."""

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {METHODS}, got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"speculative_config.{name} must be a positive integer, got {v!r}")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("speculative_config.model names the draft model: " + (
                "required with method 'draft_model'" if self.model is None else f"not allowed with {self.method!r}"))
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise ValueError(f"speculative_config.model must be a path, got {self.model!r}")
        if (self.method == "self_draft") != (self.num_draft_layers is not None):
            raise ValueError("speculative_config.num_draft_layers: " + (
                "required with method 'self_draft'" if self.num_draft_layers is None
                else f"not allowed with {self.method!r}"))
        v = self.num_draft_layers
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ValueError(f"speculative_config.num_draft_layers must be a positive integer, got {v!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | None:
        """From a dict or its JSON text; unknown keys and bad values raise ``ValueError`` naming
        the key. One of ``prompt_lookup_min``/``max`` alone sets both (as vLLM does)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        value = json_object(value, "speculative_config")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown key {unknown[0]!r}; known: {sorted(known)}")
        if "method" not in value:
            raise ValueError("speculative_config.method is required (one of " + ", ".join(METHODS) + ")")
        kw = dict(value)
        if "prompt_lookup_min" in kw and "prompt_lookup_max" not in kw:
            kw["prompt_lookup_max"] = max(kw["prompt_lookup_min"], cls.prompt_lookup_max) \
                if isinstance(kw["prompt_lookup_min"], int) else kw["prompt_lookup_min"]
        if "prompt_lookup_max" in kw and "prompt_lookup_min" not in kw:
            kw["prompt_lookup_min"] = min(kw["prompt_lookup_max"], cls.prompt_lookup_min) \
                if isinstance(kw["prompt_lookup_max"], int) else kw["prompt_lookup_max"]
        return cls(**kw)

    @property
    def uses_model(self) -> bool:
        """Drafts come from a forward pass on the device (not from the host's token lists)."""
        return self.method != "ngram"

    @property
    def draft_owns_kv(self) -> bool:
        """The draft keeps KV of its own: a cache group in the pool beside the target's."""
        return self.method == "draft_model"
