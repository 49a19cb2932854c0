"""Tiny random-weight Bamba, Granite 4.0-H and Mamba2 checkpoints, written with transformers."""
from __future__ import annotations

from pathlib import Path

import torch

ARCHS = ("bamba", "granite", "mamba2")
VOCAB = 128


def write_checkpoint(arch: str, folder: Path) -> Path:
    """A seeded random model of ``arch`` saved as an HF safetensors folder; returns the folder.
    Mamba heads of 16 dimensions with states of 16, several groups where the family has them, one
    attention layer among Mamba ones (Bamba with half-dimension RoPE, Granite without RoPE and with
    a top-2 mixture of 4 experts beside its shared MLP and its multipliers)."""
    from transformers import (
        BambaConfig,
        BambaForCausalLM,
        GraniteMoeHybridConfig,
        GraniteMoeHybridForCausalLM,
        Mamba2Config,
        Mamba2ForCausalLM,
    )

    mamba = dict(mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_chunk_size=16, mamba_expand=2)
    if arch == "bamba":
        cfg, cls = BambaConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                               num_key_value_heads=2, intermediate_size=96, attn_layer_indices=[1],
                               mamba_n_groups=2, max_position_embeddings=1024, **mamba), BambaForCausalLM
    elif arch == "granite":
        cfg, cls = GraniteMoeHybridConfig(
            vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=32, shared_intermediate_size=48, layer_types=["mamba", "mamba", "attention", "mamba"],
            num_local_experts=4, num_experts_per_tok=2, mamba_n_groups=1, embedding_multiplier=12.0,
            residual_multiplier=0.22, attention_multiplier=0.0078, logits_scaling=8.0,
            position_embedding_type="nope", max_position_embeddings=1024, **mamba), GraniteMoeHybridForCausalLM
    elif arch == "mamba2":
        cfg, cls = Mamba2Config(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_heads=8, head_dim=16,
                                state_size=16, n_groups=2, chunk_size=16, expand=2), Mamba2ForCausalLM
    else:
        raise ValueError(arch)
    torch.manual_seed(0)
    model = cls(cfg)
    with torch.no_grad():  # a sharper model than the initializer's, so greedy ties are rare
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "conv1d" not in name:
                p.mul_(4.0)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    return folder
