"""Results returned to users, mirroring vLLM's ``RequestOutput`` / ``CompletionOutput``."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


class Logprob(float):
    """vLLM's ``Logprob``, as a float: the value is the log-probability (so arithmetic, sorting
    and JSON see a number), ``logprob`` returns it as a plain float, ``rank`` is 1 + the number
    of tokens more likely over the whole vocabulary (the top-k's are 1 .. k) or None where not
    known, and ``decoded_token`` is the token's text (decoded on first read; None without a
    tokenizer). Pickles with its text decoded (the decoder does not travel)."""

    __slots__ = ("rank", "_text", "_token_id", "_decode")

    def __new__(cls, logprob: float, rank: int | None = None, decoded_token: str | None = None,
                token_id: int | None = None, decode: Callable[[int], str] | None = None) -> Logprob:
        obj = super().__new__(cls, logprob)
        obj.rank, obj._text, obj._token_id, obj._decode = rank, decoded_token, token_id, decode
        return obj

    @property
    def logprob(self) -> float:
        return float(self)

    @property
    def decoded_token(self) -> str | None:
        if self._text is None and self._decode is not None and self._token_id is not None:
            self._text, self._decode = self._decode(self._token_id), None
        return self._text

    def __reduce__(self):
        return Logprob, (float(self), self.rank, self.decoded_token)

    def __repr__(self) -> str:
        return f"Logprob(logprob={float(self)!r}, rank={self.rank!r}, decoded_token={self.decoded_token!r})"


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    """With ``SamplingParams.logprobs``: per generated token, {token id: Logprob}, the sampled
    token first, then the top-k."""
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
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    """With ``SamplingParams.prompt_logprobs``: one entry per prompt token, None for the first,
    then {token id: logprob} of that token given those before it, plus the top-k tokens'."""
