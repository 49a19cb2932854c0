"""Compile this folder's C sources into a shared library once per source and machine, cached
under ``~/.cache/kvos/kernels`` (``KVOS_CACHE_DIR`` overrides the root), and load it.

The library is written to a temporary name and renamed, so concurrent first uses (test workers,
engine processes) never load a partial file. ``KVOS_CPU_KERNELS=0`` turns the kernels off."""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
from pathlib import Path

log = logging.getLogger(__name__)

SOURCES = ("quant_matmul.c", "paged_attention.c", "paged_kv8.c", "elementwise.c", "decoder_layers.c")
CFLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared")
"""``-ffp-contract=off``: a multiply followed by an add stays two roundings (the dequantized
weights then equal the float32 reference bit for bit)."""


def cpu_supported() -> bool:
    """x86-64 with AVX2 and FMA (read from /proc/cpuinfo)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx2" in flags and "fma" in flags


def _cache_dir() -> Path:
    root = os.environ.get("KVOS_CACHE_DIR") or Path.home() / ".cache" / "kvos"
    return Path(root) / "kernels"


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None (turned off, unsupported CPU, no compiler, or a failed build,
    which is logged once)."""
    if os.environ.get("KVOS_CPU_KERNELS", "1") == "0" or not cpu_supported():
        return None
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        log.warning("CPU kernels: no C compiler found; the CPU path uses float32 torch products")
        return None
    here = Path(__file__).parent
    digest = hashlib.sha256()
    for name in SOURCES:
        digest.update((here / name).read_bytes())
    digest.update(" ".join((compiler, *CFLAGS)).encode())
    target = _cache_dir() / f"kvos_cpu_{digest.hexdigest()[:16]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
        cmd = [compiler, *CFLAGS, *(str(here / s) for s in SOURCES), "-o", str(tmp), "-lm"]
        try:
            subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120)
            os.replace(tmp, target)
        except (subprocess.SubprocessError, OSError) as e:
            detail = getattr(e, "stderr", "") or str(e)
            log.warning("CPU kernels: build failed (%s); the CPU path uses float32 torch products",
                        detail.strip()[:500])
            return None
        finally:
            tmp.unlink(missing_ok=True)
    lib = ctypes.CDLL(str(target))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.u4_matmul.argtypes = [ptr, i64, i64, ptr, ptr, ptr, i64, ptr, ctypes.c_int]
    lib.u4_matmul.restype = None
    lib.i8_matmul.argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr, ctypes.c_int]
    lib.i8_matmul.restype = None
    f32 = ctypes.c_float
    lib.paged_decode_attention.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, i64, i64, i64, ptr, i64, ptr,
                                           i64, i64, f32, ptr, ctypes.c_int]
    lib.paged_decode_attention.restype = None
    lib.paged_write.argtypes = [ptr, i64, i64, i64, i64, ptr, i64, i64, i64, ptr, i64]
    lib.paged_write.restype = None
    lib.paged_write_kv8.argtypes = [ptr, ptr, i64, i64, i64, i64, i64, ptr, ptr, i64, ctypes.c_int]
    lib.paged_write_kv8.restype = None
    lib.paged_decode_attention_kv8.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, i64, ptr, i64, i64, f32, ptr,
                                               ctypes.c_int]
    lib.paged_decode_attention_kv8.restype = None
    lib.rms_norm.argtypes = [ptr, ptr, ptr, ptr, f32, ptr, i64, i64, ctypes.c_int]
    lib.rms_norm.restype = None
    lib.rotary.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, ptr, ptr]
    lib.rotary.restype = None
    lib.llama_decode_layers.argtypes = [ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ctypes.c_int]
    lib.llama_decode_layers.restype = None
    return lib
