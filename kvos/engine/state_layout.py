"""The cache group of a model's Mamba layers, and the engine features that cannot serve it yet."""
from __future__ import annotations

from kvos.cache.spec import MambaStateSpec, default_cache_every
from kvos.config.engine import EngineConfig
from kvos.models.config import ModelConfig


def state_group(mc: ModelConfig, config: EngineConfig) -> tuple[MambaStateSpec | None, tuple[int, ...]]:
    """(the state pages' spec, the Mamba layers) for ``build_layout``; (None, ()) without Mamba
    layers. ``mamba_cache_every`` by default: ``default_cache_every`` with 16-bit KV."""
    m = mc.mamba
    if m is None:
        return None, ()
    spec = MambaStateSpec(config.block_size, len(mc.mamba_layers), m.conv_dim, m.conv_width, m.num_heads,
                          m.head_dim, m.state_size)
    every = config.mamba_cache_every
    if every is None:
        kv_block = 2 * len(mc.attention_layers) * mc.num_kv_heads * mc.head_dim * 2 * config.block_size  # 16-bit KV
        every = default_cache_every(spec.page_bytes, kv_block)
    return MambaStateSpec(**{**spec.__dict__, "cache_every": every}), tuple(mc.mamba_layers)


def refuse_with_state(config: EngineConfig, kv_cache_dtype: str, model_dtype: str) -> None:
    """ValueError naming the setting that a model with Mamba layers cannot run with."""
    if config.speculative_config is not None:
        raise ValueError("speculative_config: a Mamba layer's state cannot be rolled back past rejected drafts; "
                         "speculative decoding is not supported for models with Mamba layers")
    if config.segment_reuse:
        raise ValueError("segment_reuse: a Mamba layer's state depends on everything before a segment; "
                         "segment reuse is not supported for models with Mamba layers")
    if kv_cache_dtype != model_dtype:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not supported yet for models with Mamba layers "
                         "(use 'auto')")
    if config.kv_transfer_gb:
        raise ValueError("kv_transfer_gb: disaggregated prefill does not send Mamba states yet")
