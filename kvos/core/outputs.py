"""Results returned to users, mirroring vLLM's ``RequestOutput`` / ``CompletionOutput``."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def failed(self) -> bool:
        """The engine failed this sequence (``finish_reason == "error"``); ``stop_reason`` says why."""
        return self.finish_reason == "error"


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    """With ``SamplingParams.prompt_logprobs``: one entry per prompt token, None for the first,
    then {token id: logprob} of that token given those before it, plus the top-k tokens'."""
