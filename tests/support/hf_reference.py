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
