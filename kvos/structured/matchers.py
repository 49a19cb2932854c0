"""Each constrained sequence's grammar state, advanced with its delivered tokens.

Safety rule: a mask is only right when the matcher has consumed every token the sequence has
sampled before the step it is for, so the engine computes a step's masks after the step before
it has been collected (while the step's own forward pass runs). The engine owns one
``SequenceMatchers``; all calls come from its thread.
"""
from __future__ import annotations

from dataclasses import dataclass

import llguidance
import numpy as np

from kvos.core.structured_outputs import StructuredOutputsParams
from kvos.structured.grammars import GrammarCompiler


@dataclass
class _Seq:
    matcher: llguidance.LLMatcher
    consumed: int = 0


class SequenceMatchers:
    PARALLEL_FROM = 4
    """Batches of at least this many masks are computed on llguidance's thread pool."""

    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self._seqs: dict[str, _Seq] = {}
        self._executor: llguidance.LLExecutor | None = None
        self.masks = 0
        self.rejected = 0

    def __len__(self) -> int:
        return len(self._seqs)

    def _get(self, request_id: str, spec: StructuredOutputsParams) -> _Seq:
        s = self._seqs.get(request_id)
        if s is None:
            s = self._seqs[request_id] = _Seq(self.compiler.matcher(spec))
        return s

    def allowed_batch(self, seqs: list[tuple[str, StructuredOutputsParams, list[int]]]
                      ) -> tuple[list[str], np.ndarray]:
        """For each (request id, spec, delivered tokens), the tokens that may come next: (the
        request ids masked, int32 ``[len, words]``: bit ``t % 32`` of word ``t // 32`` set when
        token ``t`` may come), computed in parallel (the Rust side releases the GIL) when there
        are several. A sequence whose grammar has ended or broken gets no mask (its sample is
        discarded: it finishes)."""
        live = []
        for rid, spec, output_ids in seqs:
            s = self._get(rid, spec)
            self._catch_up(s, output_ids)
            if not (s.matcher.is_stopped() or s.matcher.is_error()):
                live.append((rid, s.matcher))
        words = (self.compiler.ll_tokenizer.vocab_size + 31) // 32
        out = np.empty((len(live), words), np.int32)
        self.masks += len(live)
        if len(live) < self.PARALLEL_FROM:
            for i, (_, m) in enumerate(live):
                m.unsafe_compute_mask_ptr(out[i].ctypes.data, words * 4)
        else:
            if self._executor is None:
                self._executor = llguidance.LLExecutor()
            self._executor.unsafe_compute_mask_ptr([(m, i) for i, (_, m) in enumerate(live)], out.ctypes.data,
                                                   words * 4, len(live))
        return [rid for rid, _ in live], out

    def advance(self, request_id: str, spec: StructuredOutputsParams, output_ids: list[int]) -> bool:
        """Consume the tokens of ``output_ids`` not seen yet; True when the grammar is complete
        and allows nothing more (the sequence should stop), or a token broke it (counted in
        ``rejected``: only possible when the mask was not applied)."""
        s = self._get(request_id, spec)
        self._catch_up(s, output_ids)
        return s.matcher.is_stopped() or s.matcher.is_error()

    def error(self, request_id: str) -> str | None:
        """Why ``request_id``'s grammar broke (llguidance's message, e.g. a regex whose lexer grew
        past its limits mid-generation), or None while it holds."""
        s = self._seqs.get(request_id)
        if s is None or not s.matcher.is_error():
            return None
        lines = (s.matcher.get_error() or "").strip().splitlines()  # its first line; a grammar dump follows
        return lines[0][:200] if lines else "the grammar failed"

    def _catch_up(self, s: _Seq, output_ids: list[int]) -> None:
        new = output_ids[s.consumed:]
        if new and not s.matcher.is_error():
            if not s.matcher.consume_tokens(new):
                self.rejected += 1
        s.consumed = len(output_ids)

    def drop(self, request_id: str) -> None:
        self._seqs.pop(request_id, None)
