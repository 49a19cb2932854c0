"""``EncoderWorker``: an encoder-only engine (the E of E/PD disaggregation). It holds the model's
image encoder on its own device and turns image tiles into encodings for the language engines;
it has no KV pool and no scheduler."""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class EncoderInfo:
    engine_id: str
    model_id: str
    """The model's name as the language engines' ``EngineInfo.model_id`` starts with it."""
    tokens_per_image: int
    hidden_size: int
    pid: int


class EncoderWorker:
    """Loads the model of ``engine_kwargs`` (``EngineConfig``'s keywords: model, device, dtype,
    random_weights) and runs its ``encode_images``. Calls may come from several threads: one
    batch runs at a time (``_lock``). The whole model is loaded (the loader builds it whole);
    only the encoder runs."""

    def __init__(self, engine_kwargs: dict, engine_index: int = 0, torch_threads: int | None = None) -> None:
        import torch

        from kvos.config import EngineConfig
        from kvos.models.loader import (
            load_model,
            resolve_config_path,
            resolve_model_path,
        )
        from kvos.worker.device import resolve_device
        from kvos.worker.runner import parse_dtype

        if torch_threads:
            torch.set_num_threads(torch_threads)
        config = EngineConfig(**engine_kwargs)
        path = (resolve_config_path if config.random_weights else resolve_model_path)(config.model)
        device = resolve_device(config.device)
        dtype = parse_dtype(config.dtype or ("bfloat16" if device.startswith("cuda") else "float32"))
        self.device, self.dtype = torch.device(device), dtype
        self.cfg, self.model = load_model(path, dtype, self.device, config.random_weights)
        if self.cfg.vision is None:
            raise ValueError("encoder_engines: the model takes no images")
        self.engine_id = f"encoder-{engine_index}"
        self._lock = threading.Lock()
        self.runs = 0
        self.seconds = 0.0

    def info(self) -> EncoderInfo:
        return EncoderInfo(self.engine_id, self.cfg.name, self.cfg.vision.tokens_per_image, self.cfg.hidden_size,
                           os.getpid())

    def encode(self, tiles: list[np.ndarray]) -> list:
        """Each tile's encoding, a CPU tensor ``[tokens_per_image, hidden]`` in the model's dtype
        (each its own storage, so each pickles alone), in order; one batch."""
        import torch

        with self._lock, torch.inference_mode():
            t0 = time.perf_counter()
            out = self.model.encode_images(torch.from_numpy(np.stack(tiles)).to(self.device)).to("cpu")
            self.runs += len(tiles)
            self.seconds += time.perf_counter() - t0
        return [t.clone() for t in out.unbind(0)]

    def stats(self) -> dict:
        return {"encoder_runs": self.runs, "encoder_seconds": self.seconds, "pid": os.getpid()}

    def ping(self) -> str:
        return self.engine_id

    def placement(self) -> dict:
        from kvos.distributed.ray_cluster import where_am_i

        return {**where_am_i(), "tensor_parallel_size": 1}

    def shutdown(self) -> None:
        pass
