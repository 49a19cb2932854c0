"""Compiles ``StructuredOutputsParams`` into llguidance matchers over the model's tokenizer.

llguidance (Microsoft's low-level Guidance engine, the one vLLM's ``guidance`` backend uses)
takes JSON schemas, regexes and Lark/GBNF grammars, builds token masks lazily in Rust (tens of
microseconds per token, no up-front compilation of the whole vocabulary) and has no Python
dependencies; xgrammar, the other well-kept choice, pulls torch, triton and transformers pins.

Contract: ``GrammarCompiler.matcher(spec)`` returns a fresh matcher at the grammar's start, or
raises ``ValueError`` naming the spec's field; compiled grammars are cached by
``spec.cache_key()`` (a later request with the same schema copies the cached matcher).
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from copy import copy

import llguidance

from kvos.core.structured_outputs import StructuredOutputsParams


def _clip(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "…"


def grammar_text(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar for ``spec`` (not yet checked against a tokenizer)."""
    kind = spec.kind
    opts = {"whitespace_flexible": spec.whitespace_flexible}
    if kind in ("json", "json_object"):
        schema = {"type": "object"} if kind == "json_object" else spec.json
        if isinstance(schema, str):
            schema = json.loads(schema)
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=opts)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if kind == "choice":
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
    text = spec.grammar
    if "::=" in text:  # GBNF (llama.cpp's), as vLLM's guided_grammar also accepts
        from llguidance.gbnf_to_lark import any_to_lark
        try:
            text = any_to_lark(text)
        except Exception as e:
            raise ValueError(f"{spec.field_name}.grammar: not a valid GBNF grammar ({_clip(str(e))})") from None
    return llguidance.LLMatcher.grammar_from_lark(text)


def lark_json_schema(schema: dict) -> str:
    """A Lark rule body that matches JSON valid for ``schema`` (llguidance's ``%json``)."""
    return "%json " + json.dumps(schema)


def ll_tokenizer(tokenizer, eos_token_id: int, vocab_size: int) -> llguidance.LLTokenizer:
    """llguidance's view of an HF fast tokenizer (about 1 s for 50k tokens, 10 s for 262k:
    build once per engine). Tokens past the tokenizer's own vocabulary (padded embedding rows)
    are never allowed."""
    backend = copy(tokenizer.backend_tokenizer)
    backend.no_padding()
    backend.no_truncation()
    return llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=eos_token_id, slices=None)


class GrammarCompiler:
    """Matchers for one tokenizer. Thread-safe (the server validates on its event loop while the
    engine compiles on its own thread); the tokenizer's llguidance view is built on first use."""

    def __init__(self, tokenizer, eos_token_id: int, vocab_size: int, cache_size: int = 256) -> None:
        if tokenizer is None or not hasattr(tokenizer, "backend_tokenizer"):
            self._error = "structured outputs need the model's fast (HF tokenizers) tokenizer"
        else:
            self._error = None
        self._tokenizer = tokenizer
        self._eos = eos_token_id
        self._vocab = vocab_size
        self._ll: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[tuple, llguidance.LLMatcher] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.compiled = 0
        self.cache_hits = 0

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll is None:
                if self._error is not None:
                    raise ValueError(f"structured_outputs: {self._error}")
                self._ll = ll_tokenizer(self._tokenizer, self._eos, self._vocab)
            return self._ll

    def matcher(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        """A new matcher at the start of ``spec``'s grammar; ``ValueError`` naming the field
        when the schema, regex or grammar is invalid."""
        key = spec.cache_key()
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                self.cache_hits += 1
                return cached.deep_copy()
        tok = self.ll_tokenizer
        field = f"{spec.field_name}.{spec.kind}"
        try:
            grammar = grammar_text(spec)
        except ValueError as e:  # ours name the field; a library's (llguidance's schema reader) does not
            if str(e).startswith(spec.field_name):
                raise
            raise ValueError(f"{field}: {_clip(str(e))}") from None
        except Exception as e:
            raise ValueError(f"{field}: cannot be compiled ({_clip(str(e))})") from None
        m = llguidance.LLMatcher(tok, grammar, log_level=0)
        if m.is_error():
            raise ValueError(f"{field}: {_clip(m.get_error())}")
        with self._lock:
            self.compiled += 1
            self._cache[key] = m.deep_copy()
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return m
