"""Pieces sized by probes: a head's pieces halved where its own keys, asked as queries, show the
tail estimate missing and halving mending it (`KeyClusters.build`'s default, `probed_pieces`;
docs/indexes.md, "Pieces sized by probes").

The default piece size (`clusters.default_cluster_keys`) depends on the number of keys and the
dimensions alone. On sharp heads the estimate of the pieces a query leaves unread misses by
their values (a piece's keys are too spread for a first-order value shift under a steep tilt),
and pieces of half the size mend most of it at about 1.8 times the cost of a call
(docs/benchmark-notes.md, "Pieces sized by probes (issue 25)"). Queries are not known when a
context is indexed, so `finer_pieces` asks its keys instead: `PROBE_QUERIES` of the trained
keys, evenly spaced by id, are queries of tail attention at `PROBE_BUDGET`, measured against
exact attention over every key. Where the 95th percentile of their error exceeds
`PROBE_TOLERANCE`, the pieces are halved and measured again, and the halved ones are kept
where their error is at most `PROBE_GAIN` of the first. The 95th percentile, not the 99th:
the 99th of 256 probes (their third worst) moved by a quarter to a half between two sets of
probes of the same head, the 95th of 512 by a tenth or less. On MiniLM's 144 heads
(`benchmarks/tail.py`'s two corpora) the probes' 95th percentile was 0.083-0.197 on six of the
seven heads whose real queries' 99th percentile is above 0.135 at 2 %, and at most 0.070 on
every other head. The seventh (`text-numpy` layer 3
head 1, queries at 0.179) shows under 0.05 in its keys: what its queries miss, keys as queries
do not see."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..clusters import ClusterHeads, KeyClusters
from ..measures import output_error
from . import witness_tail_attention
from .measured import exact_answers

PROBE_QUERIES = 512  # keys asked as queries
PROBE_BUDGET = 0.02  # tail attention's default budget
PROBE_TOLERANCE = 0.075  # the probes' 95th percentile error above which halved pieces are tried
PROBE_GAIN = 0.8  # halved pieces are kept where their error is at most this share of the first


def probe_error(clusters: KeyClusters, exact: torch.Tensor | None = None) -> float:
    """The 95th percentile of the output error of tail attention (at `PROBE_BUDGET`) against
    exact attention, with `PROBE_QUERIES` of the clusters' keys as queries: evenly spaced by
    id, the first and last included. `exact`: the probes' exact outputs (`exact_outputs`),
    which every cut of the same keys shares; computed here when not given."""
    heads = ClusterHeads.stacked([clusters])
    probes = _probes(clusters).unsqueeze(0)
    with torch.no_grad():
        if exact is None:
            exact = _exact_outputs(probes, heads)
        estimated = witness_tail_attention(probes, heads, budget=PROBE_BUDGET)
        error = output_error(estimated.out[0], exact)
    return error.double().quantile(0.95).item()


def exact_outputs(clusters: KeyClusters) -> torch.Tensor:
    """The probes' outputs `(PROBE_QUERIES, dv)` of exact attention over every key of
    `clusters` (after the geometry's output map), what `probe_error` measures against."""
    with torch.no_grad():
        return _exact_outputs(_probes(clusters).unsqueeze(0), ClusterHeads.stacked([clusters]))


def _probes(clusters: KeyClusters) -> torch.Tensor:
    """The probes' witnesses `(min(PROBE_QUERIES, n), d_w)`: the keys of ids evenly spaced over
    `[0, n)`, the first and last included."""
    n_keys = clusters.n_keys
    count = min(PROBE_QUERIES, n_keys)
    ids = torch.linspace(0, n_keys - 1, count, device=clusters.order.device).round().long()
    return clusters.keys_w[clusters.positions(ids)]


def _exact_outputs(probes: torch.Tensor, heads: ClusterHeads) -> torch.Tensor:
    """Exact attention of the probe witnesses `(1, m, d_w)` over the one head's keys `(m,
    dv)`, after the output map."""
    out, _ = exact_answers(probes, heads)
    return heads.geometry.output_map(out[0])


def finer_pieces(cut: Callable[[int], KeyClusters], max_keys: int) -> KeyClusters:
    """`cut(max_keys)`, the keys cut into pieces of at most `max_keys` keys, or `cut(max_keys //
    2)` where the first misses `PROBE_TOLERANCE` and the second is at most `PROBE_GAIN` of its
    error (`probe_error`). Both cuts hold the same keys, so the probes' exact attention is
    computed once."""
    pieces = cut(max_keys)
    exact = exact_outputs(pieces)
    error = probe_error(pieces, exact)
    if error <= PROBE_TOLERANCE:
        return pieces
    halved = cut(max_keys // 2)
    return halved if probe_error(halved, exact) <= PROBE_GAIN * error else pieces
