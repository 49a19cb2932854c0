"""Tensor parallelism for the attention decoders (Llama family, Qwen2/3, Gemma 3), Megatron-style.

Each rank of a group of ``size`` holds:
- attention: ``num_heads / size`` query heads and their K/V heads (``num_kv_heads / size``; when
  a model has fewer K/V heads than ranks, the one its query heads read, so each K/V head is
  replicated on ``size / num_kv_heads`` ranks); ``o_proj`` holds the matching input columns;
- MLP: ``intermediate_size / size`` columns of gate and up, the matching input columns of down;
- embeddings and LM head: ``ceil(vocab / size)`` rows of the vocabulary (the last rank's padded
  with zeros).
``o_proj`` and ``down_proj`` return partial sums that are all-reduced; the embedding returns
its rows (zeros for tokens another rank holds), all-reduced; the LM head's logits are
all-gathered and the padding cut. Norms and rotary tables are replicated.

Invariant: every rank runs the same operations in the same order (each collective is matched
on every rank), so the ranks must be driven with the same step descriptions.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from kvos.models.config import ModelConfig


@dataclass(frozen=True)
class TPGroup:
    """This process's place in a tensor-parallel group (``torch.distributed`` initialised)."""

    rank: int
    size: int
    group: Any = field(default=None, compare=False, hash=False)
    """The process group of the ranks (None: the default group)."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place."""
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' ``x`` concatenated along the last dimension, rank order."""
        x = x.contiguous()
        if x.is_cuda:
            out = torch.empty((self.size, *x.shape), dtype=x.dtype, device=x.device)
            dist.all_gather_into_tensor(out, x, group=self.group)
            return out.movedim(0, -2).reshape(*x.shape[:-1], self.size * x.shape[-1])
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank ``src``'s ``x`` on every rank, in place."""
        dist.broadcast(x, src=src, group=self.group)
        return x


@dataclass(frozen=True)
class ShardPlan:
    """Which slice of each sharded dimension rank ``rank`` of ``size`` holds."""

    rank: int
    size: int
    num_heads: int
    """Query heads per rank."""
    kv_heads: int
    """K/V heads per rank."""
    kv_start: int
    """This rank's first K/V head."""
    intermediate: int
    """MLP columns per rank."""
    vocab: int
    """Vocabulary rows per rank (the last rank's padded)."""

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab


def check_tensor_parallel(cfg: ModelConfig, size: int) -> None:
    """ValueError naming ``tensor_parallel_size`` when ``cfg`` cannot be split over ``size`` ranks."""
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {size!r}")
    if size == 1:
        return
    if cfg.mamba is not None or cfg.num_experts:
        raise ValueError(f"tensor_parallel_size {size}: models with Mamba layers or experts ({cfg.name or cfg.arch}) "
                         f"run on one device")
    if cfg.vision is not None:
        raise ValueError(f"tensor_parallel_size {size}: vision-language models ({cfg.name or cfg.arch}) run on "
                         f"one device")
    if cfg.num_heads % size:
        raise ValueError(f"tensor_parallel_size {size} must divide the model's {cfg.num_heads} attention heads")
    kv = cfg.num_kv_heads
    if (kv >= size and kv % size) or (kv < size and size % kv):
        raise ValueError(f"tensor_parallel_size {size} and the model's {kv} KV heads: one must divide the other")
    if cfg.intermediate_size % size:
        raise ValueError(f"tensor_parallel_size {size} must divide the model's MLP width {cfg.intermediate_size}")


def shard_plan(cfg: ModelConfig, rank: int, size: int) -> ShardPlan:
    check_tensor_parallel(cfg, size)
    kv = cfg.num_kv_heads
    kv_local = kv // size if kv >= size else 1
    kv_start = rank * kv_local if kv >= size else rank * kv // size
    return ShardPlan(rank, size, cfg.num_heads // size, kv_local, kv_start, cfg.intermediate_size // size,
                     -(-cfg.vocab_size // size))


def local_config(cfg: ModelConfig, plan: ShardPlan) -> ModelConfig:
    """The config one rank's modules are built with (its heads, MLP columns and vocabulary rows)."""
    return dataclasses.replace(cfg, num_heads=plan.num_heads, num_kv_heads=plan.kv_heads,
                               intermediate_size=plan.intermediate, vocab_size=plan.vocab)


def shard_param(name: str, full: torch.Tensor, cfg: ModelConfig, plan: ShardPlan) -> torch.Tensor:
    """Rank ``plan.rank``'s part of the full-model parameter ``name`` (kvos names: fused
    ``qkv_proj`` and ``gate_up_proj``); replicated parameters are returned as they are."""
    hd, p = cfg.head_dim, plan
    if name.endswith(("qkv_proj.weight", "qkv_proj.bias")):
        q, k, v = full.split([cfg.num_heads * hd, cfg.num_kv_heads * hd, cfg.num_kv_heads * hd], dim=0)
        return torch.cat([q.narrow(0, p.rank * p.num_heads * hd, p.num_heads * hd),
                          k.narrow(0, p.kv_start * hd, p.kv_heads * hd),
                          v.narrow(0, p.kv_start * hd, p.kv_heads * hd)])
    if name.endswith("o_proj.weight"):
        return full.narrow(1, p.rank * p.num_heads * hd, p.num_heads * hd)
    if name.endswith("gate_up_proj.weight"):
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.narrow(0, p.rank * p.intermediate, p.intermediate),
                          up.narrow(0, p.rank * p.intermediate, p.intermediate)])
    if name.endswith("down_proj.weight"):
        return full.narrow(1, p.rank * p.intermediate, p.intermediate)
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        rows = full[p.vocab_start: p.vocab_start + p.vocab]
        if rows.shape[0] < p.vocab:
            rows = torch.cat([rows, rows.new_zeros(p.vocab - rows.shape[0], *rows.shape[1:])])
        return rows
    if name.endswith(("o_proj.bias", "down_proj.bias")):
        raise ValueError(f"model: {name}: biases after row-parallel layers are not supported with tensor parallelism")
    return full


class VocabParallelEmbedding(nn.Module):
    """Rows ``[start, start + weight.shape[0])`` of an embedding; a token outside them gives zeros
    here, and the all-reduce adds the rank that holds it."""

    def __init__(self, weight: nn.Parameter, start: int, tp: TPGroup) -> None:
        super().__init__()
        self.weight = weight
        self.start, self.tp = start, tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside[:, None], 0)
        return self.tp.all_reduce(out)


def parallelize(model: nn.Module, cfg: ModelConfig, plan: ShardPlan, tp: TPGroup) -> None:
    """Give a model built with ``local_config`` and holding its shards its collectives: sums after
    ``o_proj`` and ``down_proj``, the vocabulary-parallel embedding, gathered logits."""
    for layer in model.layers:
        for linear in (layer.self_attn.o_proj, layer.mlp.down_proj):
            linear.register_forward_hook(lambda _m, _i, out: tp.all_reduce(out))
    tied = model.lm_head.weight is model.embed_tokens.weight
    model.embed_tokens = VocabParallelEmbedding(model.embed_tokens.weight, plan.vocab_start, tp)
    if tied:
        model.lm_head.weight = model.embed_tokens.weight
    vocab = cfg.vocab_size

    def gather_logits(_m, _i, out: torch.Tensor) -> torch.Tensor:
        full = tp.all_gather_last(out)
        return full if full.shape[-1] == vocab else full[..., :vocab].contiguous()

    model.lm_head.register_forward_hook(gather_logits)


def load_shards(local: nn.Module, full_params: dict[str, torch.Tensor], cfg: ModelConfig, plan: ShardPlan) -> None:
    """Copy each parameter's shard of ``full_params`` (kvos names) into ``local``."""
    with torch.no_grad():
        for name, p in local.named_parameters():
            p.copy_(shard_param(name, full_params[name], cfg, plan))
