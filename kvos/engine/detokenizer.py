"""Incremental detokenization and stop-string matching for one sequence."""
from __future__ import annotations

from kvos.core.sampling_params import SamplingParams


class IncrementalDetokenizer:
    """Keeps a sequence's text in step with its tokens.

    ``text`` never ends in an incomplete UTF-8 character, nor (while the sequence runs) in text
    that could still become the start of a stop string: both are held back until resolved, so a
    streamed delta is never revised and streamed text equals the final text. (Holding back is
    monotone: a suffix that could start a stop string was a candidate, hence held, in every
    earlier text too.) ``update`` returns the stop string matched, if any, and then truncates
    ``text`` before it (or after it with ``include_stop_str_in_output``); ``flush`` releases
    what is held at the end of a sequence not stopped by a string. With ``min_tokens``, a stop
    string must end in text that tokens after the first ``min_tokens`` added (vLLM's rule: the
    text of the first ``min_tokens`` tokens is never searched for an end), though it may start
    earlier; text that could start one is held back all the same.
    Without a tokenizer (random-weight models) the text stays empty and no stop string matches.

    Cost per token: two decodes of a few tokens, not of the whole output. The text so far
    (``_full``) is the decode of ``token_ids[:_read]``; each update decodes the window from
    ``_prefix`` (the previous read offset, so that a tokenizer that strips a leading space at the
    start of a decode strips it from both windows alike) with and without the new tokens, and
    appends the difference once it no longer ends in an incomplete character. Invariant: both
    offsets sit on boundaries where the decode was complete, so the shorter window's text is a
    prefix of the longer one's; for tokenizers whose decode is a concatenation (byte-level BPE,
    SentencePiece without clean-up), ``_full`` equals the decode of the whole output.
    """

    def __init__(self, tokenizer, params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.token_ids: list[int] = []
        self.seen = 0
        """Tokens the last ``update`` saw."""
        self.text = ""
        self._full = ""
        self._prefix = 0
        self._read = 0
        self._stop_max = max((len(s) for s in params.stop_strings), default=0)
        self._protected = 0
        """Characters of ``_full`` that the first ``min_tokens`` tokens added: no stop string ends there."""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.params.skip_special_tokens)

    def _pending(self) -> str:
        """The text the tokens after ``_read`` add (may end in an incomplete character)."""
        ids = self.token_ids
        return self._decode(ids[self._prefix:])[len(self._decode(ids[self._prefix:self._read])):]

    def update(self, token_ids: list[int]) -> str | None:
        self.token_ids = token_ids
        self.seen = len(token_ids)
        if self.tokenizer is None:
            return None
        delta = self._pending()
        if not delta or delta.endswith("\ufffd"):
            return None
        self._full += delta
        self._prefix, self._read = self._read, len(token_ids)
        full = self._full
        prev_len = len(self.text)
        self.text = full
        if not self._stop_max:
            return None
        if len(token_ids) <= self.params.min_tokens:
            self._protected = len(full)
        search_from = max(0, prev_len - self._stop_max + 1)
        best: tuple[int, str] | None = None
        for s in self.params.stop_strings:
            i = full.find(s, max(search_from, self._protected - len(s) + 1))
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            self.text = full[: len(full) - self._stop_prefix_len(full)]
            return None
        i, s = best
        self.text = full[: i + len(s)] if self.params.include_stop_str_in_output else full[:i]
        return s

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        for n in range(min(self._stop_max - 1, len(text)), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self.params.stop_strings):
                return n
        return 0

    def flush(self) -> None:
        """At the end of a sequence not stopped by a string: keep an incomplete last character."""
        if self.tokenizer is None:
            return
        self.text = self._full + self._pending()
