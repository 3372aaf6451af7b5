"""Each row's k largest entries of a table on the CPU, compiled by Numba: the IVF probes'
shortlist (`ivf_blocks.shortlist`), a few of several hundred lists per query.

FAISS's flat search and `torch.topk` keep a heap or a sort per row, a branch per entry, and
took several times the matrix product that scored the rows (docs/indexes.md, "The probes'
shortlist"). `_row_largest` first bounds the row's k-th largest entry from below, without a
branch: cut into k groups, each group's largest is a distinct entry, so at least k entries
reach the least of those maxima. Only the entries that reach it (a few times k) are then
ranked, each by counting the entries above it.

Numba is imported and the loop compiled (or loaded from Numba's cache) on first use, once per
process (what that costs: docs/indexes.md, "The probes' shortlist")."""

from __future__ import annotations

import numpy as np
import torch

from .compiled import compiled_loop
from .tail.threads import spread

# Rows per item spread over the threads.
ROWS_PER_ITEM = 1024
# The most entries per row `row_largest` takes: the entries that reach its bound, which it ranks
# (the square of their number), grow as k log k, and above this FAISS's search or `topk` is as
# fast (docs/indexes.md, "The probes' shortlist").
MAX_K = 24
# The fewest entries per group for which `row_largest` ranks (with fewer, nearly every entry
# reaches the bound and ranking them costs the square of the row).
MIN_GROUP = 8


def applies(k: int, n_columns: int, dtype: torch.dtype) -> bool:
    """Whether `row_largest` takes k of `n_columns` columns of a CPU table of `dtype`: float32
    or float64, k from 1 to `MAX_K` and up to a `MIN_GROUP`-th of the columns."""
    return (
        dtype in (torch.float32, torch.float64) and 1 <= k <= MAX_K and k * MIN_GROUP <= n_columns
    )


def row_largest(table: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`table.topk(k)` of a CPU table `(rows, columns)` that `applies` takes, without autograd:
    `(values, columns)`, both `(rows, k)`, largest first, ties in ascending column order. A
    table holding NaN falls back to `topk`."""
    values = table.detach().contiguous().numpy()
    columns = np.full((values.shape[0], k), -1, np.int64)
    largest = np.empty((values.shape[0], k), values.dtype)
    loop = compiled_loop(_row_largest)

    def rows(start: int) -> None:
        own = slice(start, start + ROWS_PER_ITEM)
        loop(values[own], k, columns[own], largest[own])

    spread(rows, range(0, values.shape[0], ROWS_PER_ITEM))
    if (columns < 0).any():  # only where a comparison with NaN failed
        return table.topk(k)
    return torch.from_numpy(largest), torch.from_numpy(columns)


def _row_largest(table: np.ndarray, k: int, columns: np.ndarray, largest: np.ndarray) -> None:
    """Writes each row's k largest entries of `table` `(rows, n)` into `largest` and their
    columns into `columns` `(rows, k)`, largest first, ties in ascending column order (module
    docstring). Run compiled: `compiled_loop`."""
    n_columns = table.shape[1]
    held_values = np.empty(n_columns, table.dtype)
    held_columns = np.empty(n_columns, np.int64)
    peaks = np.empty(k, table.dtype)
    taken = np.empty(k, np.bool_)
    for row in range(table.shape[0]):
        # Group g holds the columns g, g + k, g + 2k, ...: their maxima in vector lanes.
        for group in range(k):
            peaks[group] = table[row, group]
        for start in range(k, n_columns, k):
            for group in range(min(k, n_columns - start)):
                value = table[row, start + group]
                peaks[group] = value if value > peaks[group] else peaks[group]
        bound = peaks[0]
        for group in range(1, k):
            bound = peaks[group] if peaks[group] < bound else bound
        held, unordered = 0, 0
        for column in range(n_columns):  # written always, kept where it reaches the bound
            value = table[row, column]
            held_values[held] = value
            held_columns[held] = column
            held += value >= bound
            unordered += value != value
        if unordered:  # NaN: left for `topk`, which ranks it above every number
            columns[row, 0] = -1
            continue
        # An entry's rank is the number of entries above it; entries of equal value share
        # it and take the slots from there in column order.
        taken[:] = False
        for i in range(held):
            value, rank = held_values[i], 0
            for j in range(held):
                rank += 1 if held_values[j] > value else 0
            while rank < k and taken[rank]:
                rank += 1
            if rank < k:
                taken[rank] = True
                columns[row, rank] = held_columns[i]
                largest[row, rank] = value


def compile_ahead(dtypes: tuple[type, ...] = (np.float32, np.float64)) -> None:
    """Compiles the loop for tables of `dtypes` now, into Numba's cache (the image does it when
    it is built, so that a server's first shortlist compiles nothing)."""
    for dtype in dtypes:
        table = np.zeros((1, MIN_GROUP), dtype)
        compiled_loop(_row_largest)(table, 1, np.zeros((1, 1), np.int64), np.zeros((1, 1), dtype))
