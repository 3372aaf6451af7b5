"""Pieces sized by probes: a head's pieces halved where its own keys, asked as queries, show the
tail estimate missing and halving mending it (`KeyClusters.build`'s default, `probed_pieces`;
docs/indexes.md, "Pieces sized by probes").

The default piece size (`clusters.default_cluster_keys`) depends on the number of keys and the
dimensions alone. On sharp heads the estimate of the pieces a query leaves unread misses by
their values (a piece's keys are too spread for a first-order value shift under a steep tilt),
and pieces of half the size mend most of it at about 1.8 times the cost of a call
(docs/benchmark-notes.md, "Pieces sized by probes (issue 25)"). Queries are not known when a
context is indexed, so `finer_pieces` asks its keys instead: trained keys, evenly spaced by id,
are queries of tail attention at `PROBE_BUDGET`, measured against exact attention over every
key, in two steps:

- a screen: the 95th percentile of the error of `SCREEN_QUERIES` (512) probes. A head at most
  `SCREEN_TOLERANCE` there keeps its pieces: most heads, at the cost of 512 probes. Otherwise
  the pieces are halved and screened again, and a head whose halved pieces' screen error is
  above `PROBE_GAIN` of the first keeps its pieces: halving does not mend it (broad or
  overlapping keys), and it is spared the decision's exact attention;
- the decision: the 99th percentile, the one issue 25's target names, of `PROBE_QUERIES` (4096)
  probes, so that it rests on their 41 worst (a 99th percentile of 256 moved by a quarter to a
  half between two sets of probes of the same head). Where it exceeds `PROBE_TOLERANCE` and the
  halved pieces' is at most `PROBE_GAIN` of it, the halved pieces are kept.

Keys asked as queries miss less than the head's real queries: on MiniLM's heads that miss the
target at 2 % the probes' 99th percentile was 0.8-1.5 times the real queries', hence a tolerance
of 0.8 of the target (docs/benchmark-notes.md, "English prose, another corpus (issue 25)").
Some heads' real queries miss where their keys do not (`text-numpy` layer 3 head 1); only an
audit of the real queries sees those (docs/indexes.md, "The audit")."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..clusters import ClusterHeads, KeyClusters
from ..measures import output_error
from . import witness_tail_attention
from .measured import exact_answers

SCREEN_QUERIES = 512  # keys asked as queries by the screen
SCREEN_TOLERANCE = 0.04  # the screen's 95th percentile error at or below which pieces are kept
PROBE_QUERIES = 4096  # keys asked as queries by the decision
PROBE_TOLERANCE = 0.12  # the probes' 99th percentile error above which halved pieces are tried
PROBE_GAIN = 0.8  # halved pieces are kept where their error is at most this share of the first
PROBE_BUDGET = 0.02  # tail attention's default budget
PROBE_CHUNK = 1024  # probes per call of tail and exact attention


def screen_error(clusters: KeyClusters, exact: torch.Tensor | None = None) -> float:
    """The 95th percentile of the output error of tail attention (at `PROBE_BUDGET`) against
    exact attention, with `SCREEN_QUERIES` of the clusters' keys as queries (`_probes`).
    `exact`: the screen probes' exact outputs (`exact_outputs(clusters, screen_probes(...))`),
    which every cut of the same keys shares; computed here when not given."""
    probes = screen_probes(clusters)
    exact = exact_outputs(clusters, probes) if exact is None else exact
    return _errors(clusters, probes, exact).quantile(0.95).item()


def screen_probes(clusters: KeyClusters) -> torch.Tensor:
    """The screen's probe witnesses `(min(SCREEN_QUERIES, n), d_w)` (`_probes`)."""
    return _probes(clusters, SCREEN_QUERIES)


def probe_error(clusters: KeyClusters, exact: torch.Tensor | None = None) -> float:
    """The 99th percentile of the output error of tail attention (at `PROBE_BUDGET`) against
    exact attention, with `PROBE_QUERIES` of the clusters' keys as queries (`_probes`).
    `exact`: the probes' exact outputs (`exact_outputs`), which every cut of the same keys
    shares; computed here when not given."""
    probes = _probes(clusters, PROBE_QUERIES)
    exact = exact_outputs(clusters, probes) if exact is None else exact
    return _errors(clusters, probes, exact).quantile(0.99).item()


def exact_outputs(clusters: KeyClusters, probes: torch.Tensor | None = None) -> torch.Tensor:
    """The outputs `(m, dv)` of exact attention over every key of `clusters` (after the
    geometry's output map) of the probe witnesses `probes` `(m, d_w)`, by default the
    decision's (`PROBE_QUERIES`), what `probe_error` measures against."""
    probes = _probes(clusters, PROBE_QUERIES) if probes is None else probes
    heads = ClusterHeads.stacked([clusters])
    with torch.no_grad():
        return torch.cat([
            heads.geometry.output_map(exact_answers(chunk[None], heads)[0][0])
            for chunk in probes.split(PROBE_CHUNK)
        ])  # fmt: skip


def _errors(clusters: KeyClusters, probes: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """The probes' relative output errors `(m,)` in float64: tail attention at `PROBE_BUDGET`
    against `exact`."""
    heads = ClusterHeads.stacked([clusters])
    with torch.no_grad():
        estimated = torch.cat([
            witness_tail_attention(chunk[None], heads, budget=PROBE_BUDGET).out[0]
            for chunk in probes.split(PROBE_CHUNK)
        ])  # fmt: skip
    return output_error(estimated, exact).double()


def _probes(clusters: KeyClusters, count: int) -> torch.Tensor:
    """The witnesses `(min(count, n), d_w)` of the keys of ids evenly spaced over `[0, n)`,
    the first and last included."""
    n_keys = clusters.n_keys
    ids = torch.linspace(0, n_keys - 1, min(count, n_keys), device=clusters.order.device)
    return clusters.keys_w[clusters.positions(ids.round().long())]


def finer_pieces(cut: Callable[[int], KeyClusters], max_keys: int) -> KeyClusters:
    """`cut(max_keys)`, the keys cut into pieces of at most `max_keys` keys, or `cut(max_keys //
    2)` where the first's screen error exceeds `SCREEN_TOLERANCE` (`screen_error`) and its probe
    error `PROBE_TOLERANCE` (`probe_error`), and the second's errors are at most `PROBE_GAIN` of
    the first's by both measures (module docstring). Both cuts hold the same keys, so the
    probes' exact attention is computed once per measure."""
    pieces = cut(max_keys)
    screen_exact = exact_outputs(pieces, screen_probes(pieces))
    screened = screen_error(pieces, screen_exact)
    if screened <= SCREEN_TOLERANCE:
        return pieces
    halved = cut(max_keys // 2)
    if screen_error(halved, screen_exact) > PROBE_GAIN * screened:
        return pieces
    exact = exact_outputs(pieces)
    error = probe_error(pieces, exact)
    if error <= PROBE_TOLERANCE:
        return pieces
    return halved if probe_error(halved, exact) <= PROBE_GAIN * error else pieces
