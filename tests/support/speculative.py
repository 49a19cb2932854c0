"""Prompts where drafts pay and where they do not, and plain decoding's tokens computed once per
session, for the speculative decoding tests."""
from __future__ import annotations

from kvos import SamplingParams

DOC = ("Paged KV blocks of sixteen tokens are shared between requests that start with the same prefix; "
       "when memory runs out, the least recently used unreferenced block is evicted first. ")
QUOTE = f"Repeat this text word for word.\n\nText: {DOC * 2}\n\nRepeated text: Paged KV"
CODE = ("def area(w, h):\n    return w * h\n\n\ndef perimeter(w, h):\n    return 2 * (w + h)\n\n"
        "# Rewrite both functions with type hints.\ndef area(w: float, h: float) -> float:\n")
FREE = "Tell me a short story about a lighthouse keeper."


def tokens(outs) -> list[list[int]]:
    return [list(c.token_ids) for o in outs for c in o.outputs]


_plain: dict[tuple, list[list[int]]] = {}


def plain_tokens(llm, prompts: list[str], params: SamplingParams) -> list[list[int]]:
    """Plain decoding's tokens on the shared engine (computed once per prompts and params)."""
    key = (tuple(prompts), params.n, params.max_tokens)
    if key not in _plain:
        _plain[key] = tokens(llm.generate(prompts, params, use_tqdm=False))
    return _plain[key]
