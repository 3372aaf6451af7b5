"""Time and peak-memory measurement shared by the benchmarks and the memory tests."""

from __future__ import annotations

import ctypes
import ctypes.util
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def reset_peak_rss() -> None:
    """Return freed heap memory to the system (glibc `malloc_trim`), then reset the kernel's
    peak resident set size of this process (Linux >= 4.0), so that the next peak belongs to the
    next measurement and not to memory an earlier one freed."""
    libc = ctypes.util.find_library("c")
    if libc is not None:
        ctypes.CDLL(libc).malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")


def peak_rss_bytes() -> int:
    """Peak resident set size since the last reset (VmHWM)."""
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) * 1024


def current_rss_bytes() -> int:
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) * 1024


def measure(fn: Callable[[], T]) -> tuple[T, float, int]:
    """Run `fn` once: its result, wall seconds and the peak RSS (bytes) of the process during
    the call."""
    reset_peak_rss()
    start = time.perf_counter()
    result = fn()
    seconds = time.perf_counter() - start
    return result, seconds, peak_rss_bytes()


def best_times(runs: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """The fastest of `rounds` runs of each callable after a warm-up, the callables taking
    turns within each round: this machine's speed drifts by up to 2x over minutes (other
    tenants), and interleaving exposes dense and sparse attention to the same drift."""
    for fn in runs.values():
        fn()
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(rounds):
        for name, fn in runs.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def cpu_description() -> str:
    """This machine's CPU model and the vector instructions PyTorch uses on it, e.g. "AMD EPYC
    (AVX2)": CPU benchmark ratios depend on both (SDPA's CPU kernel most of all)."""
    import torch

    cpuinfo = Path("/proc/cpuinfo")
    text = cpuinfo.read_text() if cpuinfo.exists() else ""
    model = re.search(r"^model name\s*:\s*(.+)$", text, re.MULTILINE)
    name = model.group(1).strip() if model else "unknown CPU"
    return f"{name} ({torch.backends.cpu.get_cpu_capability()})"
