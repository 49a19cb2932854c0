"""Incremental detokenization and stop-string matching for one sequence."""
from __future__ import annotations

from kvos.engine.sampling_params import SamplingParams


class IncrementalDetokenizer:
    """Keeps a sequence's text in step with its tokens.

    ``text`` never ends in an incomplete UTF-8 character (held back until complete), so a
    streamed delta is never revised. ``update`` returns the stop string matched, if any, and
    then truncates ``text`` before it (or after it with ``include_stop_str_in_output``).
    Without a tokenizer (random-weight models) the text stays empty and no stop string matches.
    """

    def __init__(self, tokenizer, params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.token_ids: list[int] = []
        self.text = ""
        self._stop_max = max((len(s) for s in params.stop_strings), default=0)

    def update(self, token_ids: list[int]) -> str | None:
        self.token_ids = token_ids
        if self.tokenizer is None:
            return None
        full = self.tokenizer.decode(token_ids, skip_special_tokens=self.params.skip_special_tokens)
        if full.endswith("\ufffd"):
            return None
        prev_len = len(self.text)
        self.text = full
        if not self._stop_max:
            return None
        search_from = max(0, prev_len - self._stop_max + 1)
        best: tuple[int, str] | None = None
        for s in self.params.stop_strings:
            i = full.find(s, search_from)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        self.text = full[: i + len(s)] if self.params.include_stop_str_in_output else full[:i]
        return s

    def flush(self) -> None:
        """At the end of a sequence not stopped by a string: keep an incomplete last character."""
        if self.tokenizer is None:
            return
        self.text = self.tokenizer.decode(self.token_ids, skip_special_tokens=self.params.skip_special_tokens)
