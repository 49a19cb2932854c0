"""What kvos reads of a GGUF file's header (its ModelConfig and where each tensor lies) and the
tokenizer transformers converts from it, cached on disk so that a second load parses neither:
gguf's reader walks every tokenizer string of the header, seconds a load on a small CPU, and
every server, engine process and Ray actor loads the model again.

The cache lives in ``$KVOS_CACHE_DIR`` (default ``$XDG_CACHE_HOME/kvos``, else ``~/.cache/kvos``).
An entry's key covers the file (resolved path, size, modification time), the code that derives
the entry (this module's and the GGUF loader's source; transformers' version for tokenizers) and
``CACHE_VERSION``: any change gives a new key, never a stale entry. Entries are written to a
temporary name and renamed into place, so concurrent loads never see half an entry; a cache
that cannot be written is skipped."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kvos.models.config import ModelConfig

CACHE_VERSION = 1


@dataclass(frozen=True)
class TensorEntry:
    """One tensor's bytes in the file: ``dtype`` and ``shape`` as gguf's reader views them
    (quantized types as ``uint8`` rows of blocks), starting ``offset`` bytes into the file."""

    name: str
    ggml_type: int
    offset: int
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class GGUFIndex:
    config: ModelConfig
    arch: str
    tensors: tuple[TensorEntry, ...]


def cache_dir() -> Path:
    if os.environ.get("KVOS_CACHE_DIR"):
        return Path(os.environ["KVOS_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kvos"


def _key(path: Path, *parts: str) -> str:
    st = path.stat()
    h = hashlib.sha256(f"{CACHE_VERSION}|{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode())
    for p in parts:
        h.update(b"|" + p.encode())
    return h.hexdigest()[:32]


def _source_hash() -> str:
    from kvos.models import config, gguf_header

    return hashlib.sha256(b"".join(Path(m.__file__).read_bytes() for m in (config, gguf_header))
                          + Path(__file__).read_bytes()).hexdigest()


def _publish(build, final: Path) -> None:
    """Write an entry through ``build(tmp_dir)`` then rename ``tmp_dir`` to ``final``; best
    effort (a read-only or full cache just stays empty)."""
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=".tmp-"))
    except OSError:
        return
    try:
        build(tmp)
        os.rename(tmp, final)
    except OSError:  # another process published it first, or the disk is full or read-only
        shutil.rmtree(tmp, ignore_errors=True)


def gguf_index(path: Path) -> GGUFIndex:
    """The file's index, from the cache or by parsing its header (then cached)."""
    from kvos.models.gguf_header import field, open_gguf, read_gguf_config

    entry = cache_dir() / "gguf" / _key(path, _source_hash())
    try:
        d = json.loads((entry / "index.json").read_text())
        return GGUFIndex(ModelConfig(**d["config"]), d["arch"],
                         tuple(TensorEntry(t[0], t[1], t[2], t[3], tuple(t[4])) for t in d["tensors"]))
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        pass
    reader = open_gguf(path)
    index = GGUFIndex(read_gguf_config(reader, path), str(field(reader, "general.architecture")),
                      tuple(TensorEntry(t.name, int(t.tensor_type), int(t.data_offset), t.data.dtype.str,
                                        tuple(int(s) for s in t.data.shape)) for t in reader.tensors))
    doc = {"config": dataclasses.asdict(index.config), "arch": index.arch,
           "tensors": [[t.name, t.ggml_type, t.offset, t.dtype, list(t.shape)] for t in index.tensors]}
    _publish(lambda tmp: (tmp / "index.json").write_text(json.dumps(doc)), entry)
    return index


def cached_gguf_tokenizer(path: Path):
    """transformers' tokenizer for a GGUF file: converted from the file once, then loaded from
    the cache (``save_pretrained``'s files: vocabulary, merges, special tokens, chat template)."""
    import transformers
    from transformers import AutoTokenizer

    entry = cache_dir() / "tokenizers" / _key(path, transformers.__version__, Path(__file__).read_text())
    if (entry / "tokenizer_config.json").exists():
        try:
            return AutoTokenizer.from_pretrained(str(entry))
        except Exception:  # an entry from a broken write: convert again
            pass
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    _publish(lambda tmp: tok.save_pretrained(str(tmp)), entry)
    return tok
