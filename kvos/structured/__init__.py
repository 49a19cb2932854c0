"""Structured outputs (JSON schemas, regexes, choices, grammars) and tool calls: grammars through
llguidance, per-sequence matchers whose masks the sampler applies on the device."""
