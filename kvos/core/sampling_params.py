"""Sampling parameters, mirroring vLLM's ``SamplingParams``. Pure Python."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvos.core.structured_outputs import StructuredOutputsParams


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    ``temperature == 0`` means greedy. ``top_k <= 0`` (or -1) disables top-k. ``seed`` makes a
    request's samples reproducible whatever else shares its batch. ``prompt_logprobs=k`` returns,
    for every prompt token after the first, its logprob given the tokens before it plus the
    top-``k`` tokens' (``RequestOutput.prompt_logprobs``); such a request computes its whole
    prompt (it takes no prefix-cache hits). ``presence_penalty`` and ``frequency_penalty``
    (OpenAI's, in [-2, 2]) subtract ``presence * (count > 0) + frequency * count`` from each
    token's logit, counting the sequence's generated tokens; ``repetition_penalty`` (vLLM's and
    HF's, > 0) divides the positive logits of tokens seen in the prompt or the output by it and
    multiplies the negative ones; ``logit_bias`` maps token ids to a bias in [-100, 100] added
    to their logits. ``speculative=False`` keeps this request out of speculative decoding
    (an engine speculates only for requests without penalties, logit bias, ``min_tokens`` or
    logprobs, structured outputs). ``structured_outputs`` constrains the output to a JSON
    schema, a regex, a choice or a grammar (``StructuredOutputsParams``): a token that would
    break it is never sampled, and the sequence ends when the grammar does. While fewer than
    ``min_tokens`` tokens are generated, EOS (unless ``ignore_eos``) and ``stop_token_ids``
    cannot be sampled, and a stop string ends the sequence only where it ends in the text of a
    token after the first ``min_tokens`` (vLLM's rule). ``allowed_token_ids`` (vLLM's) lets only
    those tokens be sampled. ``bad_words`` (vLLM's) are never generated: each word is tokenized
    alone and after a space (``update_from_tokenizer``, which the engine calls), and a word's
    last token cannot be sampled where the generated tokens end with the tokens before it (a
    one-token word never can). ``truncate_prompt_tokens=k`` keeps only the prompt's last ``k``
    tokens (the engine cuts it when it tokenizes the request). Invalid values raise
    ``ValueError`` naming the field.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    speculative: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    _stop: list[str] = field(init=False, repr=False, default_factory=list)
    _bad_words_token_ids: list[list[int]] | None = field(init=False, repr=False, default=None)

    def __post_init__(self) -> None:
        if self.stop is not None and not isinstance(self.stop, (str, list, tuple)):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        self._stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        for name in ("allowed_token_ids", "bad_words"):
            if isinstance(getattr(self, name), tuple):
                setattr(self, name, list(getattr(self, name)))
        self.validate()

    @property
    def stop_strings(self) -> list[str]:
        return self._stop

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_history(self) -> bool:
        """True when sampling depends on the sequence's tokens (penalties)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def bad_words_token_ids(self) -> list[list[int]]:
        """The token sequences ``bad_words`` forbid (set by ``update_from_tokenizer``)."""
        return self._bad_words_token_ids or []

    @property
    def can_speculate(self) -> bool:
        """True when drafts may be verified for this request: it allows it and its tokens'
        distribution depends on nothing the verify step does not see (no penalties, bias,
        ``min_tokens`` ban or bad words, which read the tokens before each position; no
        ``allowed_token_ids`` mask, which the verify step does not apply; no logprobs)."""
        return (self.speculative and not self.adjusts_logits and self.logprobs is None
                and self.structured_outputs is None)

    @property
    def adjusts_logits(self) -> bool:
        """True when the sampler must change this request's logits before sampling (penalties,
        logit bias, ``min_tokens``' ban on stop tokens, ``allowed_token_ids``, ``bad_words``)."""
        return (self.needs_history or bool(self.logit_bias) or self.min_tokens > 0
                or self.allowed_token_ids is not None or bool(self.bad_words))

    def update_from_tokenizer(self, tokenizer, vocab_size: int | None = None) -> None:
        """Tokenize ``bad_words`` (vLLM's rule): each word without its leading whitespace, and
        after one space where that gives as many tokens, starting with another one (a word
        inside the text); ``ValueError`` naming ``bad_words`` for an id outside the vocabulary."""
        if not self.bad_words:
            return
        seqs: list[list[int]] = []
        for word in self.bad_words:
            bare = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
            spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            if not bare:
                raise ValueError(f"bad_words: {word!r} encodes to no tokens")
            seqs.append(bare)
            if spaced and len(spaced) == len(bare) and spaced[0] != bare[0]:
                seqs.append(spaced)
        if vocab_size is not None and any(not 0 <= t < vocab_size for ids in seqs for t in ids):
            raise ValueError(f"bad_words: a word encodes to a token id outside the vocabulary [0, {vocab_size})")
        self._bad_words_token_ids = seqs

    def validate(self, vocab_size: int | None = None) -> None:
        """ValueError naming the first bad field. Integers are never booleans and numbers are
        finite: a value the sampler cannot take must not reach a step (it would fail there)."""
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{name} {why}, got {getattr(self, name)!r}")

        for name in ("speculative", "ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "must be true or false")
        for name in ("n", "top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs",
                     "truncate_prompt_tokens"):
            if isinstance(getattr(self, name), bool):
                raise bad(name, "must be an integer, not a boolean")
        for name in ("temperature", "top_p", "min_p"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise bad(name, "must be a finite number")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise bad("structured_outputs", "must be a StructuredOutputsParams or None")
        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise bad("temperature", "must be a number >= 0")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or (self.top_k < -1):
            raise bad("top_k", "must be -1 (disabled), 0 (disabled) or a positive integer")
        if not isinstance(self.min_p, (int, float)) or not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be in [0, 1]")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "must be an integer or None")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", "must be an integer >= 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if any(not isinstance(s, str) or not s for s in self._stop):
            raise bad("stop", "must be a non-empty string or a list of non-empty strings")
        stop_ids: list = self.stop_token_ids  # a list since __post_init__
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in stop_ids):
            raise bad("stop_token_ids", "must be a list of non-negative integers")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            raise bad("logprobs", "must be an integer in [0, 20]")
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int)
                                                 or not 0 <= self.prompt_logprobs <= 20):
            raise bad("prompt_logprobs", "must be an integer in [0, 20] or None")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not -2 <= v <= 2:
                raise bad(name, "must be a number in [-2, 2]")
        rp = self.repetition_penalty
        if not isinstance(rp, (int, float)) or isinstance(rp, bool) or not 0 < rp < float("inf"):
            raise bad("repetition_penalty", "must be a number > 0")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise bad("logit_bias", "must be a dict of token id -> bias")
            for t, b in self.logit_bias.items():
                if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                    raise bad("logit_bias", "must have non-negative integer token ids as keys")
                if vocab_size is not None and t >= vocab_size:
                    raise ValueError(f"logit_bias token id {t} is outside the vocabulary [0, {vocab_size})")
                if not isinstance(b, (int, float)) or isinstance(b, bool) or not -100 <= b <= 100:
                    raise bad("logit_bias", "must have biases in [-100, 100]")
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if (not isinstance(ids, list) or not ids
                    or any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in ids)):
                raise bad("allowed_token_ids", "must be a non-empty list of non-negative integers")
            if vocab_size is not None and max(ids) >= vocab_size:
                raise ValueError(f"allowed_token_ids token id {max(ids)} is outside the vocabulary [0, {vocab_size})")
        if self.bad_words is not None and (not isinstance(self.bad_words, list) or any(
                not isinstance(w, str) or not w.strip() for w in self.bad_words)):
            raise bad("bad_words", "must be a list of strings that are not empty or only whitespace")
        k = self.truncate_prompt_tokens
        if k is not None and (not isinstance(k, int) or k < 1):
            raise bad("truncate_prompt_tokens", "must be an integer >= 1 or None")
