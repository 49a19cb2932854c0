"""Build OpenAI response bodies and stream chunks from engine outputs."""
from __future__ import annotations

import hashlib
import json
import time

from kvos.core.outputs import CompletionOutput, RequestOutput


def sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


def finish_reason(c: CompletionOutput) -> str | None:
    """``stop``, ``length``, or ``abort`` (vLLM's: the engine cut the sequence, e.g. its output
    constraint failed; ``stop_reason`` says why)."""
    if c.finish_reason is None:
        return None
    return c.finish_reason if c.finish_reason in ("length", "abort") else "stop"


def system_fingerprint(*parts: object) -> str:
    """OpenAI's ``system_fingerprint``: changes when the backend serving a model changes (here: the
    kvos version, the model's content and the KV and weight dtypes)."""
    return "fp_" + hashlib.sha256("|".join(map(str, parts)).encode("utf-8", "surrogatepass")).hexdigest()[:10]


def usage(outs: list[RequestOutput]) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in outs)},
            "completion_tokens_details": {"reasoning_tokens": 0}}


class LogprobFormatter:
    def __init__(self, tokenizer) -> None:
        self.tok = tokenizer

    def text(self, token_id: int) -> str:
        """The token's text; ``token_id:N`` without a tokenizer (as vLLM writes it)."""
        return f"token_id:{token_id}" if self.tok is None else self.tok.decode([token_id])

    def completion(self, c: CompletionOutput, start: int, offset0: int) -> dict | None:
        """Legacy completions ``logprobs`` for tokens ``start:`` of ``c``."""
        if c.logprobs is None:
            return None
        tokens, lps, tops, offsets = [], [], [], []
        offset = offset0
        for tid, entry in zip(c.token_ids[start:], c.logprobs[start:]):
            s = self.text(tid)
            tokens.append(s)
            lps.append(entry[tid])
            tops.append({self.text(t): lp for t, lp in entry.items()})
            offsets.append(offset)
            offset += len(s)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}

    def echoed(self, prompt_ids: list[int], entries: list[dict[int, float] | None] | None,
               rest: dict | None) -> dict | None:
        """``echo`` with ``logprobs``: the prompt's tokens first (the first one's logprob null,
        as OpenAI and vLLM give it), then ``rest`` (the completion's, whose offsets already
        count the echoed text). None when no logprobs were asked."""
        if rest is None or entries is None:
            return rest
        tokens, lps, tops, offsets, offset = [], [], [], [], 0
        for tid, entry in zip(prompt_ids, entries):
            s = self.text(tid)
            tokens.append(s)
            lps.append(None if entry is None else entry[tid])
            tops.append(None if entry is None else {self.text(t): lp for t, lp in entry.items()})
            offsets.append(offset)
            offset += len(s)
        return {"tokens": tokens + rest["tokens"], "token_logprobs": lps + rest["token_logprobs"],
                "top_logprobs": tops + rest["top_logprobs"], "text_offset": offsets + rest["text_offset"]}

    def prompt(self, entries: list[dict[int, float] | None]) -> list[dict | None]:
        """vLLM's ``prompt_logprobs``: per prompt token None (the first) or {token id (a JSON
        string): {"logprob", "rank", "decoded_token"}}, the prompt token first, then the top-k.
        ``rank`` is the engine's (1 + the number of tokens more likely, over the vocabulary)."""
        out: list[dict | None] = []
        for entry in entries:
            if entry is None:
                out.append(None)
                continue
            out.append({str(t): {"logprob": float(lp), "rank": lp.rank, "decoded_token": self.text(t)}
                        for t, lp in entry.items()})
        return out

    def chat(self, c: CompletionOutput, start: int, top_n: int) -> dict | None:
        if c.logprobs is None:
            return None
        content = []
        for tid, entry in zip(c.token_ids[start:], c.logprobs[start:]):
            s = self.text(tid)
            top = sorted(((t, lp) for t, lp in entry.items()), key=lambda x: -x[1])[:top_n]
            content.append({"token": s, "logprob": entry[tid], "bytes": list(s.encode()),
                            "top_logprobs": [{"token": self.text(t), "logprob": lp,
                                              "bytes": list(self.text(t).encode())} for t, lp in top]})
        return {"content": content}


def prompt_text(out: RequestOutput, tokenizer) -> str:
    """The prompt as text (``echo``): as sent, or its token ids decoded."""
    if out.prompt is not None:
        return out.prompt
    return tokenizer.decode(out.prompt_token_ids)


def completion_body(rid: str, model: str, outs: list[RequestOutput], n: int, lp: LogprobFormatter,
                    fingerprint: str, echo: bool = False, token_ids: bool = False,
                    prompt_logprobs: bool = True) -> dict:
    """``echo``: each choice's text starts with its prompt's; prompt logprobs (vLLM's
    ``prompt_logprobs``) come as a list on each choice; ``token_ids``: so do the prompt's and the
    completion's token ids (vLLM's ``return_token_ids``)."""
    choices = []
    for i, o in enumerate(outs):
        head = prompt_text(o, lp.tok) if echo else ""
        for c in o.outputs:
            logprobs = lp.completion(c, 0, len(head))
            if echo:
                logprobs = lp.echoed(o.prompt_token_ids, o.prompt_logprobs, logprobs)
            choice = {"index": i * n + c.index, "text": head + c.text, "logprobs": logprobs,
                      "finish_reason": finish_reason(c), "stop_reason": c.stop_reason}
            if o.prompt_logprobs is not None and prompt_logprobs:
                choice["prompt_logprobs"] = lp.prompt(o.prompt_logprobs)
            if token_ids:
                choice.update(prompt_token_ids=o.prompt_token_ids, token_ids=list(c.token_ids))
            choices.append(choice)
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "system_fingerprint": fingerprint, "choices": choices, "usage": usage(outs)}


def chat_message(c: CompletionOutput, tools=None) -> tuple[dict, str | None]:
    """The choice's message and finish reason: with active tools (``ChatTools``) the calls found
    in the reply go to ``tool_calls`` (finish reason ``tool_calls``) and the rest stays content."""
    reason = finish_reason(c)
    if tools is None or not tools.active:
        return {"role": "assistant", "content": c.text}, reason
    content, calls = tools.parse(c.text)
    if not calls:
        return {"role": "assistant", "content": c.text}, reason
    return ({"role": "assistant", "content": content, "tool_calls": [call.as_openai() for call in calls]},
            "tool_calls" if reason == "stop" else reason)


def chat_body(rid: str, model: str, out: RequestOutput, lp: LogprobFormatter, top_n: int,
              fingerprint: str, token_ids: bool = False, tools=None) -> dict:
    choices = []
    for c in out.outputs:
        message, reason = chat_message(c, tools)
        choices.append({"index": c.index, "message": message, "logprobs": lp.chat(c, 0, top_n),
                        "finish_reason": reason, "stop_reason": c.stop_reason,
                        **({"prompt_token_ids": out.prompt_token_ids, "token_ids": list(c.token_ids)}
                           if token_ids else {})})
    body = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "system_fingerprint": fingerprint, "choices": choices, "usage": usage([out])}
    if out.prompt_logprobs is not None:  # vLLM's place for them in a chat response
        body["prompt_logprobs"] = lp.prompt(out.prompt_logprobs)
    return body
