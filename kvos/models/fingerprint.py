"""What a cached block's content depends on, as one string: the root of every hash chain.

Two engines share a block (on the device, or through a disk or Redis tier) only when their
fingerprints are equal, so the fingerprint covers the model's content, not its file name: the
bytes of its weight files and config (two different ``model.gguf`` files never share blocks; a
renamed copy of the same file does), the KV dtype, and the version of a block's byte layout.
"""
from __future__ import annotations

import functools
from pathlib import Path

import xxhash

KV_LAYOUT_VERSION = "kv-layout-3"
"""Bump whenever the bytes of a stored block change meaning (2: the page-major pool, one block
holding every layer of its group; 3: 8-bit caches store V token-minor within a block)."""


@functools.lru_cache(maxsize=16)
def _file_digest(path: str, size: int, mtime_ns: int) -> str:
    """xxh3-128 of a file's bytes (cached per path, size and modification time)."""
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            h.update(chunk)
    return h.hexdigest()


def file_digest(path: Path) -> str:
    st = path.stat()
    return _file_digest(str(path), st.st_size, st.st_mtime_ns)


def model_fingerprint(path: Path, kv_dtype: str, random_weights: bool = False) -> str:
    """The hash root's model identity: a GGUF file's bytes; an HF folder's config.json and
    safetensors files; for random weights, the config file (the weights follow from it and a fixed
    seed)."""
    if random_weights or path.is_file():
        files = [path]
    else:
        files = [path / "config.json", *sorted(path.glob("*.safetensors"))]
    h = xxhash.xxh3_128()
    for f in files:
        h.update(file_digest(f).encode())  # content only: a renamed copy is the same model
    kind = "random-seed-0" if random_weights else "weights"
    return f"{h.hexdigest()}:{kind}:{kv_dtype}:{KV_LAYOUT_VERSION}"
