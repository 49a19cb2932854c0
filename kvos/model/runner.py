"""The tensor side of the engine: owns the model, the paged K/V tensors and the sampler."""
from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from kvos.engine.scheduler import SchedulerOutput
from kvos.model.attention import AttentionBackend, AttentionMetadata, TorchReferenceBackend
from kvos.model.loader import load_model
from kvos.model.sampler import SampledToken, Sampler, SampleRow

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
          "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


class ModelRunner:
    """Executes one scheduled step: copy-on-write copies, the forward pass, sampling.

    The K/V tensor is ``[num_layers, 2, num_blocks, block_size, kv_heads, head_dim]``; block ids
    from the KV memory system index its third dimension. It is zero-initialised so that padding
    (the null block) is finite.
    """

    def __init__(self, model_path: Path, dtype: torch.dtype, device: torch.device,
                 backend: AttentionBackend | None = None) -> None:
        self.device = device
        self.dtype = dtype
        self.cfg, self.model = load_model(model_path, dtype, device)
        self.backend = backend or TorchReferenceBackend()
        self.sampler = Sampler()
        self.kv_caches: torch.Tensor | None = None
        self.block_size = 0
        self._generators: dict[str, torch.Generator] = {}
        self.logits_hook: Callable[[list[str], torch.Tensor], None] | None = None
        """Called with (request ids, float32 logits rows) each step before sampling; a debugging
        and testing aid that must not modify the tensor."""

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        c = self.cfg
        self.block_size = block_size
        self.kv_caches = torch.zeros(c.num_layers, 2, num_blocks, block_size, c.num_kv_heads,
                                     c.head_dim, dtype=self.dtype, device=self.device)

    def read_block(self, block_id: int) -> bytes:
        """One block's K and V across all layers as bytes (only valid while the block's content
        is what its owner says: call before the block is handed to someone else)."""
        assert self.kv_caches is not None
        return self.kv_caches[:, :, block_id].contiguous().view(torch.uint8).cpu().numpy().tobytes()

    def write_block(self, block_id: int, data: bytes) -> None:
        """Fill a block from ``read_block`` bytes (only into a block its request owns). On a GPU
        the bytes go through a pinned staging buffer."""
        assert self.kv_caches is not None
        dst = self.kv_caches[:, :, block_id]
        with warnings.catch_warnings():  # read-only view of immutable bytes: never written
            warnings.simplefilter("ignore", UserWarning)
            src = torch.frombuffer(data, dtype=torch.uint8)
        if dst.device.type == "cuda":
            staging = getattr(self, "_staging", None)
            if staging is None or staging.numel() < src.numel():
                staging = self._staging = torch.empty(src.numel(), dtype=torch.uint8).pin_memory()
            staging[: src.numel()].copy_(src)
            src = staging[: src.numel()]
        dst.copy_(src.view(self.dtype).view(dst.shape))

    def _generator(self, req) -> torch.Generator | None:
        seed = req.sampling_params.seed
        if seed is None or req.sampling_params.greedy:
            return None
        gen = self._generators.get(req.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed((seed + 0x9E3779B97F4A7C15 * req.sample_index) % (1 << 63))
            self._generators[req.request_id] = gen
        return gen

    def _prepare(self, out: SchedulerOutput):
        seqs = sorted(out.seqs, key=lambda s: s.num_new_tokens != 1)  # decodes first (stable)
        bs = self.block_size
        ids, pos, query_lens, seq_lens = [], [], [], []
        max_blocks = max(len(s.block_ids) for s in seqs)
        tables = torch.zeros(len(seqs), max_blocks, dtype=torch.long)
        logit_rows, row_ids, sample_rows, targets = [], [], [], []
        t = 0
        for i, s in enumerate(seqs):
            ids.extend(s.token_ids)
            pos.append((s.start, s.num_new_tokens))
            query_lens.append(s.num_new_tokens)
            seq_lens.append(s.start + s.num_new_tokens)
            tables[i, : len(s.block_ids)] = torch.tensor(s.block_ids, dtype=torch.long)
            t += s.num_new_tokens
            if s.samplers:
                row = len(logit_rows)
                logit_rows.append(t - 1)
                row_ids.append(s.request.request_id)
                for target in s.samplers:
                    sample_rows.append(SampleRow(row, target.sampling_params, self._generator(target)))
                    targets.append(target.request_id)
        positions = torch.cat([torch.arange(a, a + n) for a, n in pos])
        seq_idx = torch.repeat_interleave(torch.arange(len(seqs)), torch.tensor(query_lens))
        slots = tables[seq_idx, positions // bs] * bs + positions % bs
        meta = AttentionMetadata(
            slot_mapping=slots.to(self.device), block_tables=tables.to(self.device),
            seq_lens=torch.tensor(seq_lens, device=self.device), query_lens_list=query_lens,
            seq_lens_list=seq_lens, num_decodes=sum(1 for n in query_lens if n == 1), block_size=bs)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        return input_ids, positions.to(self.device), meta, logit_rows, row_ids, sample_rows, targets

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> dict[str, SampledToken]:
        """Run one step; returns a sampled token for every sampling target of the step."""
        for rid in out.finished_ids:
            self._generators.pop(rid, None)
        assert self.kv_caches is not None, "allocate_kv_cache first"
        for src, dst in out.copies:
            self.kv_caches[:, :, dst].copy_(self.kv_caches[:, :, src])
        if out.is_empty:
            return {}
        input_ids, positions, meta, logit_rows, row_ids, sample_rows, targets = self._prepare(out)
        hidden = self.model(input_ids, positions, self.kv_caches, meta, self.backend)
        if not logit_rows:
            return {}
        logits = self.model.compute_logits(hidden[torch.tensor(logit_rows, device=self.device)])
        if self.logits_hook is not None:
            self.logits_hook(row_ids, logits)
        return dict(zip(targets, self.sampler(logits, sample_rows)))
