"""GPU kernel times of one prefill step (16 x 512 new tokens) and one eager decode step (256
sequences of 640 tokens) of a bundled config's random weights (default llama-3.1-8b; first
argument: another config), from torch.profiler."""
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from kvos import LLM
from kvos.models.attention import AttentionMetadata

llm = LLM(model=sys.argv[1] if len(sys.argv) > 1 else "llama-3.1-8b", random_weights=True, device="cuda", max_num_batched_tokens=8192,
          max_num_seqs=256, enforce_eager=True)
r = llm.engine.runner
bs, dev = r.block_size, "cuda"


def meta_for(nseq, qlen, ctx):
    nb = -(-ctx // bs)
    tables = torch.arange(1, 1 + nseq * nb, dtype=torch.int32, device=dev).view(nseq, nb)
    pos = torch.arange(ctx - qlen, ctx, device=dev).repeat(nseq)
    seq = torch.arange(nseq, device=dev).repeat_interleave(qlen)
    slots = tables[seq, pos // bs].long() * bs + pos % bs
    decode = qlen == 1
    return pos, AttentionMetadata(
        slot_mapping=slots, block_tables=tables, seq_lens=torch.full((nseq,), ctx, dtype=torch.int32, device=dev),
        query_lens_list=[qlen] * nseq, seq_lens_list=[ctx] * nseq, num_decodes=nseq if decode else 0,
        block_size=bs, prefill_start_loc=None if decode else torch.arange(0, nseq * qlen + 1, qlen, dtype=torch.int32, device=dev),
        max_prefill_len=0 if decode else qlen)


for name, (nseq, qlen, ctx) in {"prefill 16x512": (16, 512, 512), "decode 256 x ctx 640": (256, 1, 640)}.items():
    pos, meta = meta_for(nseq, qlen, ctx)
    ids = torch.randint(3, 1000, (nseq * qlen,), device=dev)
    with torch.inference_mode():
        for _ in range(2):
            r.model.compute_logits(r.model(ids, pos, r.kv_caches, meta, r.backend)[-nseq:])
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            r.model.compute_logits(r.model(ids, pos, r.kv_caches, meta, r.backend)[-nseq:])
            torch.cuda.synchronize()
    print("==", name)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
