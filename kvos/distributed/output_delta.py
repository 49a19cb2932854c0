"""Engine outputs on the wire as deltas: an engine process sends what each request gained since
its last poll (new token ids, text, logprobs), not its cumulative output; the front end rebuilds
the cumulative ``RequestOutput`` that its streams read.

At 256 running requests an engine answers a poll after every step. Pickled cumulative outputs
grow with every token (every token id so far, per request, per step), and the pickling holds the
engine process's GIL while its stepping thread needs it. A delta is a few plain tuples.

A delta is ``(request_id, finished, num_cached_tokens, metrics or None, prompt_logprobs or None,
completions)``; each completion is ``(index, new_token_ids, new_text, new_logprobs or None,
cumulative_logprob, finish_reason, stop_reason)``. ``metrics`` travel when they changed,
``prompt_logprobs`` with a request's first delta.
"""
from __future__ import annotations

from kvos.core.outputs import CompletionOutput, RequestOutput

OutputDelta = tuple


class DeltaEncoder:
    """Engine side: what was sent of each unfinished request. Not thread-safe: one caller at a
    time (the worker holds its lock). A request is forgotten once its finished delta is made, or
    by ``forget`` (aborted: no finished output comes)."""

    def __init__(self) -> None:
        self._sent: dict[str, tuple[dict, dict[int, tuple[int, int, int]]]] = {}

    def __len__(self) -> int:
        return len(self._sent)

    def encode(self, out: RequestOutput) -> OutputDelta:
        prev = self._sent.get(out.request_id)
        sent_metrics, counts = prev if prev is not None else (None, {})
        comps, now = [], {}
        for c in out.outputs:
            n, t, k = counts.get(c.index, (0, 0, 0))
            lp = c.logprobs
            comps.append((c.index, c.token_ids[n:], c.text[t:], None if lp is None else lp[k:],
                          c.cumulative_logprob, c.finish_reason, c.stop_reason))
            now[c.index] = (len(c.token_ids), len(c.text), 0 if lp is None else len(lp))
        if out.finished:
            self._sent.pop(out.request_id, None)
        else:
            self._sent[out.request_id] = (out.metrics, now)
        return (out.request_id, out.finished, out.num_cached_tokens,
                None if out.metrics == sent_metrics else out.metrics,
                out.prompt_logprobs if prev is None else None, tuple(comps))

    def forget(self, request_id: str) -> None:
        self._sent.pop(request_id, None)


class _Completion:
    __slots__ = ("ids", "text", "logprobs")

    def __init__(self, with_logprobs: bool) -> None:
        self.ids: list[int] = []
        self.text = ""
        self.logprobs: list | None = [] if with_logprobs else None


class OutputAccumulator:
    """Front-end side: one request's cumulative output, rebuilt from its deltas in order (the
    first delta must be the engine's first for this request)."""

    def __init__(self, prompt: str | None, prompt_token_ids: list[int]) -> None:
        self.prompt, self.prompt_token_ids = prompt, prompt_token_ids
        self.metrics: dict = {}
        self.prompt_logprobs = None
        self._comps: dict[int, _Completion] = {}

    def apply(self, delta: OutputDelta) -> RequestOutput:
        """The cumulative output after ``delta``: a fresh object that later deltas leave as it is."""
        rid, finished, cached, metrics, plp, comps = delta
        if metrics is not None:
            self.metrics = metrics
        if plp is not None:
            self.prompt_logprobs = plp
        outs = []
        for index, ids, text, lps, cum, reason, stop in comps:
            acc = self._comps.get(index)
            if acc is None:
                acc = self._comps[index] = _Completion(lps is not None)
            acc.ids.extend(ids)
            acc.text += text
            if lps is not None:
                acc.logprobs.extend(lps)
            outs.append(CompletionOutput(index, acc.text, list(acc.ids), cum,
                                         None if acc.logprobs is None else list(acc.logprobs), reason, stop))
        return RequestOutput(rid, self.prompt, self.prompt_token_ids, outs, finished, num_cached_tokens=cached,
                             metrics=dict(self.metrics),
                             prompt_logprobs=None if self.prompt_logprobs is None else list(self.prompt_logprobs))
