"""Which tokens to recompute when a segment's KV is reused at another position: an offline study
on the default model (SmolLM2-135M, CPU), on `kvos bench segments`' RAG set.

For each prompt (an instruction, three documents, a question) and the reference's greedy
continuation (full prefill, 24 tokens), a hand-written forward pass over the model's own layers
computes, per layer, only a chosen set of rows: every row that is not a document's, plus the
recomputed document rows; the other document rows take their KV from the document computed alone
(keys rotated to the new positions). The perplexity of the continuation, teacher-forced, is
compared with full prefill's. Rules, each at the same share of document tokens:

- ``head``: each document's first tokens, at every layer (kvos's rule, EPIC's);
- ``cacheblend_l1``: CacheBlend's: every row computed at layers 0-1, the rows whose layer-1 K/V
  deviate most from the reused K/V kept from layer 2 on;
- ``cacheblend_l2_sink4``: the same selected at layer 2, plus each document's first 4 tokens;
- ``deviation_l1_sink4``: the rows of largest layer-1 deviation plus the first 4, at every layer;
- ``oracle_kv``: the rows whose reused K/V differ most from full prefill's, summed over layers;
- ``question_attention_sink4``: the rows the question attends to most (full prefill's attention,
  summed over layers), plus the first 4 (an oracle of query-aware selection);
- ``deep_layers`` (``_sink4``): no document row is recomputed in the first layers; the last
  ``ceil(share * layers)`` layers compute every row, each document entering them with the
  residual stream it had when computed alone (the layers, not the tokens, are the share; with
  ``_sink4`` each document's first 4 tokens are computed at every layer).

    python benchmarks/scripts/segments_selection.py --prompts 12 --output benchmarks/results/segments-selection-cpu.json
"""
from __future__ import annotations

import argparse
import json
import math
import time

import torch
import torch.nn.functional as F

from kvos import LLM, SamplingParams
from kvos.bench.machine import machine_info
from kvos.bench.segments import build_set
from kvos.models import ops

RULES = ("head", "cacheblend_l1", "cacheblend_l2_sink4", "deviation_l1_sink4", "oracle_kv",
         "question_attention_sink4", "deep_layers", "deep_layers_sink4")


class Study:
    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self.model = llm.engine.runner.model
        if type(self.model).__name__ != "LlamaForCausalLM":
            raise SystemExit("this study's forward pass is Llama's (the default model)")
        self.L = self.model.cfg.num_layers

    def forward(self, ids, sets, reused=None, record=False, qrows=None, inject=None):
        """Rows ``sets[l]`` (bool [N], non-increasing, except at ``inject``'s layer) computed at
        layer l; the others' K/V from ``reused`` (per layer, keys before rotation). ``inject =
        (d, streams)``: at layer d the rows of ``sets[d]`` not computed before enter with
        ``streams[d]`` (the residual stream entering layer d, [N, hidden]: a document's own,
        computed alone). Returns the last computed rows' hidden states, each layer's K/V and
        entering stream (``record``), and the attention mass of rows ``qrows`` per key."""
        m = self.model
        N = len(ids)
        pos = torch.arange(N)
        x, residual, cur = m.embed_tokens(torch.tensor(ids)), None, torch.ones(N, dtype=torch.bool)
        kvs, attn, streams = [], [], []
        for i, ly in enumerate(m.layers):
            if inject is not None and i == inject[0]:
                full = inject[1][i].clone()
                full[cur] = x + residual if residual is not None else x
                x, residual = full[sets[i]], torch.zeros_like(full[sets[i]])
            else:
                keep = sets[i][cur]
                x = x[keep]
                residual = residual[keep] if residual is not None else None
            if record:
                streams.append(x + residual if residual is not None else x)
            cur = sets[i]
            r = pos[cur]
            att = ly.self_attn
            if residual is None:
                residual, h = x, ly.input_layernorm(x)
            else:
                h, residual = ly.input_layernorm(x, residual)
            q, k, v = att.qkv_proj(h).split([att.q_size, att.kv_size, att.kv_size], dim=-1)
            q, k, v = q.view(-1, att.nh, att.hd), k.view(-1, att.nkv, att.hd), v.view(-1, att.nkv, att.hd)
            K = reused[i][0].clone() if reused is not None else torch.zeros(N, att.nkv, att.hd)
            V = reused[i][1].clone() if reused is not None else torch.zeros(N, att.nkv, att.hd)
            K[r], V[r] = k, v
            if record:
                kvs.append((K.clone(), V.clone()))
            rope = m.layer_rotary(i)
            qr, _ = ops.rotary_reference(r, q, k, rope.cos, rope.sin)
            _, Kr = ops.rotary_reference(pos, K, K, rope.cos, rope.sin)
            rep = att.nh // att.nkv
            Kh, Vh = Kr.repeat_interleave(rep, 1).transpose(0, 1), V.repeat_interleave(rep, 1).transpose(0, 1)
            qh = qr.transpose(0, 1)
            mask = r[:, None] >= pos[None, :]
            o = F.scaled_dot_product_attention(qh, Kh, Vh, attn_mask=mask, scale=att.scale)
            if qrows is not None:
                sc = ((qh[:, qrows] @ Kh.transpose(1, 2)) * att.scale).masked_fill(~mask[qrows][None], float("-inf"))
                attn.append(sc.softmax(-1).sum((0, 1)))
            h, residual = ly.post_attention_layernorm(att.o_proj(o.transpose(0, 1).reshape(-1, att.q_size)), residual)
            x = ly.mlp(h)
        if record:
            kvs = (kvs, streams)
        return m.norm(x, residual)[0], kvs, attn

    def prompt(self, segs, shares) -> dict:
        eng = self.llm.engine
        _, ids, spans = eng.tokenize_segments(segs)
        out = self.llm.generate([{"prompt_token_ids": ids}],
                                SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)[0]
        cont = list(out.outputs[0].token_ids)
        full = ids + cont[:-1]
        N, L = len(full), self.L
        tgt = torch.tensor(cont)
        everything = torch.ones(N, dtype=torch.bool)
        qs = spans[-1][0]
        hid, (kv_full, _), qattn = self.forward(full, [everything] * L, record=True, qrows=torch.arange(qs, len(ids)))

        def nll(h) -> float:
            return float(-torch.log_softmax(self.model.compute_logits(h[-len(cont):]).double(), -1)
                         .gather(1, tgt[:, None]).sum())

        header = eng.scheduler.segments.header
        docs = spans[1:-1]
        cfg = self.model.cfg
        reused = [(torch.zeros(N, cfg.num_kv_heads, cfg.head_dim), torch.zeros(N, cfg.num_kv_heads, cfg.head_dim))
                  for _ in range(L)]
        docmask = torch.zeros(N, dtype=torch.bool)
        streams = [torch.zeros(N, cfg.hidden_size) for _ in range(L)]
        for s, e in docs:
            src = header + ids[s:e]
            _, (alone, alone_streams), _ = self.forward(src, [torch.ones(len(src), dtype=torch.bool)] * L,
                                                        record=True)
            for layer in range(L):
                reused[layer][0][s:e] = alone[layer][0][len(header):]
                reused[layer][1][s:e] = alone[layer][1][len(header):]
                streams[layer][s:e] = alone_streams[layer][len(header):]
            docmask[s:e] = True
        ndoc = int(docmask.sum())
        dev = [(kv_full[i][0] - reused[i][0]).pow(2).sum((1, 2)) + (kv_full[i][1] - reused[i][1]).pow(2).sum((1, 2))
               for i in range(L)]

        def top(score, share):
            sel = torch.zeros(N, dtype=torch.bool)
            k = math.ceil(share * ndoc)
            if k:
                sel[score.masked_fill(~docmask, -1).topk(k).indices] = True
            return sel

        def heads(share, at_least=0):
            sel = torch.zeros(N, dtype=torch.bool)
            for s, e in docs:
                sel[s: s + max(at_least, math.ceil(share * (e - s)))] = True
            return sel

        def every_layer(sel):
            return [~docmask | sel] * L

        def blend(share, layer, sink):
            # layers <= layer compute every row: their K/V are full prefill's (kv_full)
            score = dev[layer].clone()
            if sink:
                score[heads(0, sink)] = float("inf")
            return [everything] * (layer + 1) + [~docmask | top(score, share)] * (L - layer - 1)

        def deep(share, sink):
            # the last ceil(share * L) layers compute every row, documents entering with their own
            # stream from the layer before (a document computed alone); the layers before reuse
            d = L - math.ceil(share * L)
            return [~docmask | heads(0, sink)] * d + [everything] * (L - d), (d, streams)

        res = {"tokens": N, "doc_tokens": ndoc, "continuation": len(cont), "nll_full": nll(hid), "rules": {}}
        for share in shares:
            for rule, sink in (("deep_layers", 0), ("deep_layers_sink4", 4)):
                sets, inject = deep(share, sink)
                res["rules"][f"{rule}@{share}"] = nll(self.forward(full, sets, reused, inject=inject)[0])
            sets = {"head": every_layer(heads(share)),
                    "cacheblend_l1": blend(share, 1, 0),
                    "cacheblend_l2_sink4": blend(share, 2, 4),
                    "deviation_l1_sink4": every_layer(top(dev[1], share) | heads(0, 4)),
                    "oracle_kv": every_layer(top(sum(dev), share)),
                    "question_attention_sink4": every_layer(top(sum(qattn), share) | heads(0, 4))}
            for rule, s in sets.items():
                res["rules"][f"{rule}@{share}"] = nll(self.forward(full, s, reused)[0])
        return res


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--prompts", type=int, default=12)
    p.add_argument("--shares", nargs="+", type=float, default=[0.05, 0.15, 0.3])
    p.add_argument("--output", default="benchmarks/results/segments-selection-cpu.json")
    a = p.parse_args()
    torch.set_grad_enabled(False)
    t0 = time.perf_counter()
    llm = LLM(kv_cache_memory_bytes=1 << 29, segment_reuse=True)  # (its header: what a source chain starts with)
    _, prompts = build_set(llm.get_tokenizer(), 6, 300, 3, 24, 0)  # kvos bench segments' set (its defaults)
    study = Study(llm)
    per_prompt = [study.prompt(segs, a.shares) for segs in prompts[: a.prompts]]
    n = sum(r["continuation"] for r in per_prompt)
    ref = math.exp(sum(r["nll_full"] for r in per_prompt) / n)
    table = {}
    for key in per_prompt[0]["rules"]:
        ppl = math.exp(sum(r["rules"][key] for r in per_prompt) / n)
        table[key] = {"perplexity": ppl, "ppl_delta_pct": 100 * (ppl / ref - 1)}
    for share in a.shares:
        print(f"share {share:.2f}: " + ", ".join(f"{rule} {table[f'{rule}@{share}']['ppl_delta_pct']:+.2f}%"
                                                 for rule in RULES))
    json.dump({"machine": machine_info(), "model": "SmolLM2-135M-Instruct (default)", "prompts": len(per_prompt),
               "reference_perplexity": ref, "rules": table, "per_prompt": per_prompt,
               "seconds": time.perf_counter() - t0}, open(a.output, "w"), indent=1)


if __name__ == "__main__":
    main()
