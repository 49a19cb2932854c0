"""Steps with prefill rows (alone or beside decodes) as CUDA graphs of everything between the
attention kernels, at a ladder of token counts (piecewise graphs)."""
from __future__ import annotations

import torch

from kvos.models.attention import AttentionMetadata, KVCache
from kvos.models.llama import MLP, Attention, DecoderLayer, LlamaForCausalLM
from kvos.worker.cuda_graphs import capture, upload, warm_up
from kvos.worker.triton_attention import TritonBackend


def token_ladder(max_tokens: int) -> list[int]:
    """Every 32 tokens up to 512, every 64 up to 1,024, every 256 beyond; the last size is the
    first one at or above ``max_tokens``. Padding costs matrix-product time once a step is
    compute-bound (a few hundred rows on a large GPU), so the steps stay fine there."""
    sizes, n = [], 0
    while n < max_tokens:
        n += 32 if n < 512 else 64 if n < 1024 else 256
        sizes.append(n)
    return sizes


class MixedStepGraphs:
    """A Llama-family forward pass for up to ``max_tokens`` tokens of any mix of decodes and
    prefill chunks, as ``num_layers + 1`` graphs per token count ``b`` of the ladder:

    - piece 0: embeddings, layer 0's input norm, q/k/v with RoPE, K/V written into the cache;
    - piece i: layer i-1's output projection, post-attention norm and MLP, then layer i's input
      norm, q/k/v, RoPE and K/V write;
    - the last piece: the last layer's output projection and MLP, the final norm.

    Between pieces the attention itself runs eagerly over the step's real rows (it reads only
    the paged cache, so its shapes and host metadata may change from step to step without a
    recapture). Pieces pass q, the attention output and the residual stream through static
    buffers. A step of ``n`` tokens runs the smallest captured ``b >= n``: rows ``n..b`` are
    padding (slot -1: no cache write; outputs dropped).

    Safety rules: the KV pool and the model must outlive the graphs (replays use their
    addresses); the hidden states ``run`` returns are overwritten by the next ``run``; steps
    are replayed on the stream they were captured for, one at a time.
    """

    def __init__(self, model: LlamaForCausalLM, kv_layers: list[KVCache], layer_group: list[int],
                 num_groups: int, backend: TritonBackend, max_tokens: int) -> None:
        cfg, dev, dtype = model.cfg, model.embed_tokens.weight.device, model.embed_tokens.weight.dtype
        self.model, self.kv_layers, self.layer_group, self.backend = model, kv_layers, layer_group, backend
        self.sizes = token_ladder(max_tokens)
        self.max_tokens = self.sizes[-1]
        b = self.max_tokens
        self.nh, self.hd = cfg.num_heads, cfg.head_dim
        self.input_ids = torch.zeros(b, dtype=torch.long, device=dev)
        self.positions = torch.zeros(b, dtype=torch.long, device=dev)
        self.slots = torch.full((num_groups, b), -1, dtype=torch.long, device=dev)
        self.q = torch.zeros(b, self.nh, self.hd, dtype=dtype, device=dev)
        self.o = torch.zeros(b, self.nh * self.hd, dtype=dtype, device=dev)
        self.residual = torch.zeros(b, cfg.hidden_size, dtype=dtype, device=dev)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.steps = 0
        """Steps run through the graphs (for tests and stats)."""
        pool = None
        num_pieces = len(model.layers) + 1
        for size in reversed(self.sizes):  # largest first: smaller graphs reuse its memory pool
            warm_up(dev, lambda size=size: [self._piece(i, size) for i in range(num_pieces)])
            graphs = []
            for i in range(num_pieces):
                graph, out = capture(lambda i=i, size=size: self._piece(i, size), pool)
                pool = graph.pool()
                graphs.append(graph)
            self.graphs[size], self.outputs[size] = graphs, out
        # all rows are padding: nothing is written to the cache
        upload((g for graphs in self.graphs.values() for g in graphs), dev)

    @staticmethod
    def supports(model: torch.nn.Module, backend: object) -> bool:
        """True for the plain Llama-family model (Llama, Qwen2/3, Mistral) on the Triton backend."""
        return (type(model) is LlamaForCausalLM and isinstance(backend, TritonBackend)
                and all(type(layer) is DecoderLayer and type(layer.self_attn) is Attention
                        and type(layer.mlp) is MLP for layer in model.layers))

    def _piece(self, i: int, b: int) -> torch.Tensor | None:
        """Piece ``i`` at ``b`` rows (see the class docstring); the last returns the hidden states."""
        layers = self.model.layers
        if i == 0:
            residual = self.model.embed_tokens(self.input_ids[:b])
            x = layers[0].input_layernorm(residual)
        else:
            prev = layers[i - 1]
            x = prev.self_attn.o_proj(self.o[:b])
            x, residual = prev.post_attention_layernorm(x, self.residual[:b])
            x = prev.mlp(x)
            if i == len(layers):
                return self.model.norm(x, residual)[0]
            x, residual = layers[i].input_layernorm(x, residual)
        q, k, v = layers[i].self_attn.project(x, self.positions[:b], self.model.rope)
        self.backend.write(k, v, self.kv_layers[i], self.slots[self.layer_group[i], :b])
        self.q[:b].copy_(q)
        self.residual[:b].copy_(residual)
        return None

    def can_run(self, num_tokens: int) -> bool:
        return num_tokens <= self.max_tokens

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
            layer_metas: list[AttentionMetadata]) -> torch.Tensor:
        """Hidden states ``[n, hidden]`` of a step's n tokens (inputs on the device; ``slots``
        ``[groups, n]``; ``layer_metas[i]``: layer i's attention metadata)."""
        n = input_ids.shape[0]
        size = next(s for s in self.sizes if s >= n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slots[:, :n].copy_(slots)
        self.slots[:, n:size].fill_(-1)
        q, o = self.q[:n], self.o[:n].view(n, self.nh, self.hd)
        graphs = self.graphs[size]
        for i, layer in enumerate(self.model.layers):
            graphs[i].replay()
            a = layer.self_attn
            self.backend.attend(q, self.kv_layers[i], layer_metas[i], a.scale, a.window, o)
        graphs[-1].replay()
        self.steps += 1
        return self.outputs[size][:n]
