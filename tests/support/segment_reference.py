"""transformers fed reused segment KV: the reference that segment reuse is tested against.

The document's KV comes from transformers computing it after ``header`` alone; its keys are
rotated here by the position delta with RoPE written out (``rotate_half`` form, each layer's own
base and linear scaling read from transformers' config), then appended to the exactly computed
prefix's cache, and the rest of the prompt is computed over both."""
from __future__ import annotations

import torch


def layer_inv_freq(cfg, layer: int, head_dim: int) -> torch.Tensor:
    """Layer ``layer``'s RoPE inverse frequencies from transformers' config: per layer type
    (Gemma 3's sliding and full layers) where the config has types, with linear scaling."""
    kind = (getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers)[layer]
    params = getattr(cfg, "rope_parameters", None) or {}
    if kind in params:
        params = params[kind]
    theta = params.get("rope_theta") or getattr(cfg, "rope_theta", None)
    if kind == "sliding_attention" and "rope_theta" not in params:
        theta = cfg.rope_local_base_freq
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if params.get("rope_type") == "linear":
        inv = inv / params["factor"]
    return inv


def rotate(k: torch.Tensor, delta: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """Keys ``[.., seq, head_dim]`` rotated forward by ``delta`` positions."""
    d = k.shape[-1]
    angle = delta * inv_freq
    cos = torch.cat([angle.cos(), angle.cos()]).to(k.dtype)
    sin = torch.cat([angle.sin(), angle.sin()]).to(k.dtype)
    rotated = torch.cat([-k[..., d // 2:], k[..., : d // 2]], dim=-1)
    return k * cos + rotated * sin


@torch.no_grad()
def reused_segment_reference(hf, prefix, doc, rest, steps: int, header=()) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and first logits for ``prefix + doc + rest`` when doc's KV is its KV computed
    after ``header`` alone, keys rotated by ``len(prefix) - len(header)``."""
    from transformers import DynamicCache

    cfg = hf.config
    cfg = getattr(cfg, "text_config", cfg)
    h = len(header)
    pre = hf(torch.tensor([prefix]), use_cache=True).past_key_values
    alone = hf(torch.tensor([[*header, *doc]]), use_cache=True).past_key_values
    cache = DynamicCache(config=cfg)
    for layer in range(cfg.num_hidden_layers):
        kp, vp = pre.layers[layer].keys, pre.layers[layer].values
        kd, vd = alone.layers[layer].keys[:, :, h:], alone.layers[layer].values[:, :, h:]
        kd = rotate(kd, len(prefix) - h, layer_inv_freq(cfg, layer, kd.shape[-1]))
        cache.update(torch.cat([kp, kd], dim=2), torch.cat([vp, vd], dim=2), layer)
    pos = len(prefix) + len(doc)
    ids, tokens, first = torch.tensor([rest]), [], None
    for _ in range(steps):
        n = ids.shape[1]
        out = hf(ids, past_key_values=cache, position_ids=torch.arange(pos, pos + n)[None],
                 cache_position=torch.arange(pos, pos + n), use_cache=True)
        logits = out.logits[0, -1]
        first = logits if first is None else first
        tokens.append(int(logits.argmax()))
        pos += n
        ids = torch.tensor([[tokens[-1]]])
    return tokens, first
