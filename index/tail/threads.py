"""Threads besides the caller's: tail attention's workers for what runs outside PyTorch and
releases the GIL (numpy's products, the compiled loops), `background_threads`, the pools of
every thread that may run PyTorch's operations beside the one that computes (the build threads
of `LocalMemory` and of the service's engine), and `one_blas_thread`, numpy's BLAS kept on the
calling thread for tail attention's small products."""

from __future__ import annotations

import functools
import itertools
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch
from threadpoolctl import ThreadpoolController

T = TypeVar("T")


def background_threads(workers: int, name: str) -> ThreadPoolExecutor:
    """A pool of `workers` threads named `name` whose PyTorch CPU operations run on one thread
    each (PyTorch's thread count is a setting per thread; the caller's is unchanged).

    Under OpenMP, a thread that runs PyTorch's parallel operations gets a team of helper threads
    of its own. A second team on the same cores made the helpers of both give up spinning and
    sleep between operations, so that every small parallel operation of either thread paid a
    wake-up; with one thread, a pool's thread makes no team (measured in docs/
    benchmark-notes.md, "Two threads running PyTorch")."""
    return ThreadPoolExecutor(
        workers, thread_name_prefix=name, initializer=torch.set_num_threads, initargs=(1,)
    )


@functools.cache
def cpu_workers() -> ThreadPoolExecutor:
    """As many threads as PyTorch's CPU threads when first asked (`background_threads`). A
    forked child gets its own (the parent's threads do not exist in it)."""
    return background_threads(max(1, torch.get_num_threads()), "rewa-tail")


os.register_at_fork(after_in_child=cpu_workers.cache_clear)


def spread(work: Callable[[T], object], items: Sequence[T]) -> None:
    """`work(item)` for every item, on the calling thread and on up to as many `cpu_workers` as
    PyTorch has CPU threads besides it (one hand-off per thread, not per item). Each thread takes
    the next item not yet taken until none is left, so a thread that drew quick items takes more
    of them (the heads of a decode step differ in cost: docs/benchmark-notes.md, "Items taken
    in turn"). `work` must release the GIL (a compiled
    loop, numpy's products) for the threads to run at once. A thread whose item raises takes no
    more items; the others run to the end, and the first error is raised."""
    threads = min(torch.get_num_threads(), len(items))
    if threads <= 1:
        for item in items:
            work(item)
        return
    taken = itertools.count()  # next() on it is atomic under the GIL

    def run() -> None:
        while (position := next(taken)) < len(items):
            work(items[position])

    others = [cpu_workers().submit(run) for _ in range(1, threads)]
    try:
        run()
    finally:
        for other in others:
            other.result()


@functools.cache
def _blas_threads() -> ThreadpoolController:
    return ThreadpoolController()


def one_blas_thread():
    """A context in which numpy's BLAS runs on one thread, PyTorch's own threads unchanged.

    For numpy's products of a tail call's small matrices: with more than one thread, numpy's
    BLAS (OpenBLAS) leaves its threads spinning after each call, and PyTorch's parallel
    operations that follow on a two-core machine wait for the core they hold (measured in
    docs/benchmark-notes.md, "Numpy's BLAS on one thread")."""
    return _blas_threads().limit(limits=1, user_api="blas")
