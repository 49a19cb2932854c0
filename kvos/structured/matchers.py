"""Each constrained sequence's grammar state, advanced with its delivered tokens.

Safety rule: a mask is only right when the matcher has consumed every token the sequence has
sampled, so the engine computes masks only with no step in flight for that sequence (its
``num_pending == 0``). The engine owns one ``SequenceMatchers``; all calls come from its thread.
"""
from __future__ import annotations

from dataclasses import dataclass

import llguidance

from kvos.core.structured_outputs import StructuredOutputsParams
from kvos.structured.grammars import GrammarCompiler


@dataclass
class _Seq:
    matcher: llguidance.LLMatcher
    consumed: int = 0


class SequenceMatchers:
    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self._seqs: dict[str, _Seq] = {}
        self.masks = 0
        self.rejected = 0

    def __len__(self) -> int:
        return len(self._seqs)

    def _get(self, request_id: str, spec: StructuredOutputsParams) -> _Seq:
        s = self._seqs.get(request_id)
        if s is None:
            s = self._seqs[request_id] = _Seq(self.compiler.matcher(spec))
        return s

    def allowed(self, request_id: str, spec: StructuredOutputsParams, output_ids: list[int]) -> bytes:
        """The packed mask (int32 words, bit ``t % 32`` of word ``t // 32`` set when token ``t``
        may come next) after ``output_ids``, the sequence's delivered tokens."""
        s = self._get(request_id, spec)
        self._catch_up(s, output_ids)
        self.masks += 1
        return s.matcher.compute_bitmask()

    def advance(self, request_id: str, spec: StructuredOutputsParams, output_ids: list[int]) -> bool:
        """Consume the tokens of ``output_ids`` not seen yet; True when the grammar is complete
        and allows nothing more (the sequence should stop), or a token broke it (counted in
        ``rejected``: only possible when the mask was not applied)."""
        s = self._get(request_id, spec)
        self._catch_up(s, output_ids)
        return s.matcher.is_stopped() or s.matcher.is_error()

    def _catch_up(self, s: _Seq, output_ids: list[int]) -> None:
        new = output_ids[s.consumed:]
        if new and not s.matcher.is_error():
            if not s.matcher.consume_tokens(new):
                self.rejected += 1
        s.consumed = len(output_ids)

    def drop(self, request_id: str) -> None:
        self._seqs.pop(request_id, None)
