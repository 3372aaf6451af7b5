"""Which clusters each query reads exactly.

Which clusters a query visits: its most massive clusters by estimate (twice as many as the
budget holds at the average size of its head's clusters, plus 8), in descending order, each
taken if its keys still fit in the `budget` (a fraction of the context's keys), with the
clusters flagged `exact_read` (the outlier keys of `KeyClusters.build`) right after the most
massive one: at the smallest budgets the query's own cluster goes first (what putting the
outliers before it cost is measured in docs/library.md, "Cluster-tail attention"). The most
massive is read even where it alone exceeds the budget: a budget smaller than one cluster (a
short context at 1 %) would otherwise leave the query's mass unread and its output wrong by
about its own size (docs/indexes.md, "A budget smaller than a cluster")."""

from __future__ import annotations

import numpy as np
import torch

# The widest selection found by rounds of `argmax`; wider ones (contexts of about 500,000 keys
# and more at 2 %) by `topk`, whose cost grows with the width more slowly
# (docs/benchmark-notes.md, "Measurements behind code choices").
MAX_ARGMAX_WIDTH = 96


def select_clusters(
    log_mass: torch.Tensor,
    counts: torch.Tensor,
    budget_keys: float,
    exact_read: torch.Tensor | None = None,
    widths: np.ndarray | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The clusters each query visits, as `(query, cluster)` pairs: its most massive clusters
    by estimate, in descending order, the first always, each other taken if its keys still fit
    in `budget_keys`. The
    clusters flagged `exact_read` come right after each query's most massive cluster, whatever
    their estimate: read by every query whose budget holds them besides that cluster.

    `log_mass` is `(nq, nc)`; `counts` and `exact_read` are `(nc,)`, the same for every query,
    or `(nq, nc)`, a row per query (the stacked heads of `tail_attention_heads`). How many of
    its most massive clusters a query looks at (`walk_widths` of the average size of its
    clusters outside `exact_read`) may be given as `widths` `(nq,)`, and is computed here
    otherwise: a head's queries look as far in a stack of heads as in a call of their own."""
    if budget_keys <= 0:
        empty = torch.zeros(0, dtype=torch.long, device=log_mass.device)
        return empty, empty
    n_rows = log_mass.shape[0]
    forced = None
    ordinary_counts = counts
    if exact_read is not None and exact_read.any():
        log_mass = log_mass.masked_fill(exact_read, float("-inf"))
        ordinary_counts = counts.masked_fill(exact_read, 0)
        if exact_read.dim() == 1:
            forced = exact_read.nonzero().squeeze(-1).expand(n_rows, -1)
            forced_sizes = counts[forced]
        else:
            # Each row's flagged clusters, in ascending order; rows with fewer are padded with
            # unflagged clusters of size 0 (never taken).
            n_forced = int(exact_read.sum(-1).max())
            forced = (~exact_read).to(torch.uint8).argsort(dim=-1, stable=True)[:, :n_forced]
            forced_sizes = counts.gather(1, forced) * exact_read.gather(1, forced)
    if widths is None:
        widths = walk_widths(average_sizes(ordinary_counts), budget_keys, log_mass.shape[-1])
    width = int(widths.max())
    best = _most_massive(log_mass, width)
    sizes = ordinary_counts[best] if ordinary_counts.dim() == 1 else ordinary_counts.gather(1, best)
    if widths.ndim and (widths < width).any():
        # A row's candidates beyond its own width are never taken: size 0.
        beyond = torch.arange(width) >= torch.from_numpy(widths).unsqueeze(-1)
        sizes = sizes.masked_fill(beyond.to(sizes.device), 0)
    if forced is not None:
        best = torch.cat([best[:, :1], forced, best[:, 1:]], dim=1)
        sizes = torch.cat([sizes[:, :1], forced_sizes, sizes[:, 1:]], dim=1)
    if sizes.device.type == "cpu":
        # The walk is `width` steps of a few small operations each, and numpy's cost less per
        # operation than PyTorch's (docs/benchmark-notes.md, "Measurements behind code choices").
        sizes = sizes.detach().numpy()
    chosen = sizes > 0  # overwritten column by column; the most massive is read whatever its size
    remaining = budget_keys - sizes[:, 0]
    for column in range(1, sizes.shape[1]):
        size = sizes[:, column]
        chosen[:, column] = (size <= remaining) & (size > 0)
        remaining = remaining - size * chosen[:, column]
    queries, slots = torch.as_tensor(chosen, device=best.device).nonzero(as_tuple=True)
    return queries, best[queries, slots]


def average_sizes(counts: torch.Tensor) -> np.ndarray:
    """The average size of the non-empty clusters of each row of `counts` `(..., C)`: `(...)`
    in float64 (the sizes are whole numbers, which float32 sums hold exactly)."""
    sums = counts.sum(-1).double().cpu().numpy()
    return sums / np.maximum((counts > 0).sum(-1).cpu().numpy(), 1)


def ordinary_averages(counts: torch.Tensor, exact_read: torch.Tensor) -> np.ndarray:
    """`average_sizes` of each head's clusters `(H, C)` outside `exact_read` `(H, C)`: `(H,)`,
    what the walk's widths are made from in `select_clusters`."""
    return average_sizes(counts.masked_fill(exact_read, 0))


def walk_widths(average: np.ndarray, budget_keys: float, n_columns: int) -> np.ndarray:
    """How many of a query's most massive clusters the greedy walk looks at, for each average
    cluster size in `average`: twice as many as `budget_keys` holds at that size, plus a few
    (at most `n_columns`)."""
    widths = 2 * (budget_keys / np.maximum(average, 1.0)).astype(np.int64) + 8
    return np.minimum(widths, n_columns)


def _most_massive(log_mass: torch.Tensor, width: int) -> torch.Tensor:
    """The columns of the `width` largest entries of each row `(nq, width)`, largest first.

    On the CPU, up to `MAX_ARGMAX_WIDTH` columns, `width` rounds of numpy's `argmax` (ties: the
    lower column first), each masking the entry it found with `-inf`, which costs less than
    `topk` for the few columns a query reads (docs/benchmark-notes.md, "Measurements behind code
    choices"). A row whose finite entries run out would get a masked column twice; then `topk`
    answers instead."""
    if (
        log_mass.device.type != "cpu"
        or log_mass.dtype not in (torch.float32, torch.float64)
        or width > MAX_ARGMAX_WIDTH
    ):
        return log_mass.topk(width, dim=-1).indices
    masses = log_mass.detach().numpy()
    remaining = masses.copy()
    n_rows, n_columns = remaining.shape
    row_starts = np.arange(n_rows) * n_columns
    flat = remaining.reshape(-1)
    best = np.empty((width, n_rows), dtype=np.int64)
    for column in range(width):
        best[column] = remaining.argmax(axis=1)
        flat[row_starts + best[column]] = -np.inf
    if np.isneginf(masses.reshape(-1)[row_starts + best[-1]]).any():
        return log_mass.topk(width, dim=-1).indices
    return torch.from_numpy(best.T)
