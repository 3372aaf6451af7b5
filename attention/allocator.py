"""Keep glibc from returning tile-sized buffers to the operating system between operations.

Tiled attention allocates and frees the same few megabyte-sized buffers thousands of times. With
glibc's defaults those blocks are mmapped or trimmed on free, so every new tile starts with page
faults on fresh zeroed pages, which slows the distance geometries' dense attention
(docs/benchmark-notes.md, "Measurements behind code choices"). `retain_freed_memory()` raises
glibc's mmap threshold to its maximum (32 MiB) and its trim threshold to 512 MiB, once per
process. Set `REWA_MALLOC_TUNING=0` to leave the allocator alone (for example when running
under jemalloc or tcmalloc).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024
TRIM_THRESHOLD_BYTES = 512 * 1024 * 1024

_applied: bool | None = None


def retain_freed_memory() -> bool:
    """Apply the glibc settings once; returns whether they are in force."""
    global _applied
    if _applied is None:
        _applied = os.environ.get("REWA_MALLOC_TUNING", "1") != "0" and _set_glibc_thresholds()
    return _applied


def _set_glibc_thresholds() -> bool:
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(
        mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
        and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )
