"""transformers as the numerical reference: plain greedy decoding with its own KV cache."""
from __future__ import annotations

import torch


@torch.inference_mode()
def hf_greedy(model, ids: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """``steps`` greedy tokens after ``ids`` (EOS not special) and each step's float32 logits on
    the CPU, with transformers' own (sliding-window aware) KV cache. Only the last position's
    logits are computed (``logits_to_keep=1``): a long prompt's full-vocabulary logits would
    double the reference's prefill time on the CPU and are never compared."""
    dev = model.lm_head.weight.device
    past, cur, tokens, logits = None, torch.tensor([ids], device=dev), [], []
    for _ in range(steps):
        out = model(input_ids=cur, past_key_values=past, use_cache=True, logits_to_keep=1)
        past = out.past_key_values
        row = out.logits[0, -1].float().cpu()
        tokens.append(int(row.argmax()))
        logits.append(row)
        cur = torch.tensor([[tokens[-1]]], device=dev)
    return tokens, logits


def greedy_with_logits(llm, prompt_ids: list[list[int]], max_tokens: int, n: int = 1):
    """``llm``'s greedy outputs (``ignore_eos``) for token-id prompts and, per request id, the
    float32 logits row of each sampling step (the runner's ``logits_hook``, removed after)."""
    from kvos import SamplingParams

    logits: dict[str, list[torch.Tensor]] = {}
    llm.engine.runner.logits_hook = lambda ids, rows: [logits.setdefault(i, []).append(r.clone())
                                                       for i, r in zip(ids, rows)]
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids],
                            SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, n=n),
                            use_tqdm=False)
    finally:
        llm.engine.runner.logits_hook = None
    return outs, logits
