"""Threads for tail attention's work that runs outside PyTorch and releases the GIL (numpy's
products, the compiled exact part)."""

from __future__ import annotations

import functools
import os
from concurrent.futures import ThreadPoolExecutor

import torch


@functools.cache
def cpu_workers() -> ThreadPoolExecutor:
    """As many threads as PyTorch's CPU threads when first asked. A forked child gets its own
    (the parent's threads do not exist in it)."""
    return ThreadPoolExecutor(max(1, torch.get_num_threads()), thread_name_prefix="rewa-tail")


os.register_at_fork(after_in_child=cpu_workers.cache_clear)
