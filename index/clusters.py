"""The clustered representation of a context's keys behind cluster-tail attention
(docs/mathematics.md 6, "Tail estimate").

Keys are partitioned by k-means (FAISS's, computed in PyTorch on the keys' device) on their
exact lift vectors. Every estimate works in *feature space*: the lift similarity of a query and a
key (`rewa.attention.geometry.lift_similarity`) is affine in a key feature vector `b(k)`,
`s = <a(q), b(k)> + c(q)`, per lift:

- inner-product lift `(x_q, x_k)`: `a = x_q`, `b = x_k`, `c = 0`;
- L2 lift: `s = -|x_q - x_k|^2`, so `a = (2 x_q, -1)`, `b = (x_k, |x_k|^2)`, `c = -|x_q|^2`.

A geometry's logit is a function of these similarities (`Geometry.similarity_logits`), so the
first two moments of each cluster's features determine the mean and variance of every query's
similarities to the cluster's keys exactly. Per cluster c the representation keeps:

- `counts` n_c, the feature `mean` mu_c, and `radius` (per lift): the largest `|b - mu_c|`,
  which bounds every similarity to `s_bar +- |a| radius`;
- the feature covariance `Sigma_c ~ F_c F_c^T + diag(residual_c)`: `factor` F_c = U_c
  Lambda_c^(1/2) (D x r) from its top r eigenpairs (by subspace iteration where 2 r < D,
  `_leading_eigh`), `residual` the diagonal of what they leave out; `rank = D` keeps the full
  covariance;
- `value_mean` m_c and `value_cross` `Cov(b, v)` (D x dv), the full key-value
  cross-covariance. It is kept whole, unlike the key covariance: on the `text` heads of
  `benchmarks/tail.py` (dot product, 1 % of keys read) the estimate's error is set by the
  value shift's rank (median 0.058 -> 0.043 on head 9 going from rank 16 to full) and hardly by
  the variance's (rank 4 and full within 0.003; the log-partition's error halves from rank 4
  to full, docs/benchmark-notes.md);
- the keys' witnesses and values sorted by cluster (`offsets` delimit each cluster), which
  the exact part of tail attention reads;
- `exact_read` `(nc,)`: clusters that every query reads exactly, right after its most massive
  cluster, when the budget holds them (`tail.select_clusters`). `build` puts the keys farthest
  from their k-means centre into one such cluster, the last: those at least `outlier_distance`
  away, the distance of the `outliers` fraction (0.1 % by default) of the trained keys farthest
  from theirs; a few far keys make a cluster's logits heavy-tailed where the Gaussian
  estimate assumes a light tail. On the `text` heads of `benchmarks/tail.py` (dot product,
  1 % of keys read, the same k-means clusters with and without; ad-hoc script) this lowered
  the worst heads' p99 error (head 8: 0.160 -> 0.136, head 9: 0.123 -> 0.107) and left the
  others within noise; keys far from their centre in absolute distance did better than in
  distance relative to their cluster's spread, or than the keys of largest norm.

- the k-means `centroids` (in the concatenated lift space) that the keys were assigned to.

Pieces. A centre's keys form its group, and a group is cut into pieces, the clusters above
(`group` names each one's centre). The first cuts are drawn on the group's trained keys: a set
of more than `max_keys` of them is cut across its principal axis (the set's largest spread) at
a wide gap between the keys' projections that keeps ceil(m / max_keys) pieces in all
(`_split`; docs/mathematics.md 6, "Pieces"), and each side is cut again, so a piece is a compact
slab of its group. Every key, trained or appended, goes down its group's cuts
(`<b(k), axis> >= threshold`: second side) to its piece, and a piece that comes to hold more
than `max_keys` keys is cut in two across the principal axis of its
first `max_keys + 1` keys (its keys in context order), each side again while it holds too many.
So no piece holds more than `max_keys` keys. Two reasons for pieces (docs/mathematics.md 6,
"Pieces"): a query's most massive cluster must fit in a small budget (k-means groups range over
0.5-3x their mean size), and the moments of a smaller, tighter cluster estimate it better.
`default_cluster_keys` sizes them.

k-means and the first cuts learn from the first `growth.trained_prefix(n)` keys only, and a
later cut from a piece's first keys, so the pieces do not depend on how the keys arrived:
`extend` (appended keys assigned to a piece each, pieces cut where they overfill, and only the
pieces that changed recomputed) gives the representation `build` gives over the same keys
(docs/indexes.md).

`to_bytes` / `from_bytes` serialise everything but the geometry (numpy `.npz`, no pickle).
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace

import numpy as np
import torch

from rewa.attention import Geometry, Lift

from .growth import retrains, trained_prefix
from .kmeans import cluster_means
from .kmeans import kmeans as torch_kmeans
from .kmeans import nearest as nearest_centroids

DEFAULT_RANK = 4
DEFAULT_KEYS_PER_CLUSTER = 512
DEFAULT_OUTLIERS = 0.001
DEFAULT_MAX_CLUSTER_KEYS = 256
MIN_CLUSTER_KEYS = 32
# `probed_pieces` measures contexts of at least this many trained keys (below, 2 % of the keys is
# not much more than one piece).
MIN_PROBED_KEYS = 16384
SUMMARY_RATIO = 8  # a cluster's keys and values take at least 8x its cross-covariance
STATISTICS_BATCH_ELEMENTS = 1 << 22  # elements of one batch of clusters' statistics


@dataclass
class QueryFeatures:
    """Per-lift query features: `a` `(nq, D)` (every lift's block, in lift order), the constant
    `c` `(nq, P)`, and the block boundaries of each lift in D."""

    a: torch.Tensor
    c: torch.Tensor
    slices: list[slice]


def key_features(lifts: list[Lift]) -> torch.Tensor:
    """Key features `b` `(n, D)`: each lift's block, concatenated."""
    blocks = []
    for lift in lifts:
        x = lift.vectors
        if lift.metric == "l2":
            x = torch.cat([x, x.square().sum(-1, keepdim=True)], dim=-1)
        blocks.append(x)
    return torch.cat(blocks, dim=-1)


def query_features(lifts: list[Lift]) -> QueryFeatures:
    """Query features such that every lift similarity is `<a_block, b_block> + c`."""
    blocks, constants = [], []
    for lift in lifts:
        x = lift.vectors
        if lift.metric == "l2":
            blocks.append(torch.cat([2 * x, -torch.ones_like(x[..., :1])], dim=-1))
            constants.append(-x.square().sum(-1))
        else:
            blocks.append(x)
            constants.append(torch.zeros_like(x[..., 0]))
    return QueryFeatures(torch.cat(blocks, -1), torch.stack(constants, -1), _lift_blocks(lifts))


def check_clusterable(geometry: Geometry) -> None:
    """Raise unless the geometry has an exact lift, which every estimate reads."""
    if not geometry.exact_lift:
        raise ValueError(
            f"cluster attention estimates logits from lift similarities, which "
            f"{type(geometry).__name__} does not have (no exact lift); use an IVF, HNSW, "
            f"flat or LSH index (topk) or dense attention"
        )


@dataclass(frozen=True)
class _Groups:
    """What `KeyClusters.build` learns before cutting pieces: the k-means `centroids` of the
    trained keys, every key's group `labels` `(n,)` (`n_centres` for the outlier group), the
    `outlier_distance`, the number of groups (centres, and the outliers' if any) and the
    covariance `rank` the pieces' statistics keep."""

    geometry: Geometry
    centroids: torch.Tensor
    outlier_distance: torch.Tensor
    labels: torch.Tensor
    n_centres: int
    n_groups: int
    rank: int


@dataclass
class KeyClusters:
    """A context's keys partitioned into clusters, with per-cluster statistics (module
    docstring). Build with `KeyClusters.build`."""

    geometry: Geometry
    order: torch.Tensor  # (n,) original key id of each sorted position
    offsets: torch.Tensor  # (nc + 1,) cluster c holds sorted positions offsets[c]:offsets[c+1]
    keys_w: torch.Tensor  # (n, d_w) key witnesses, sorted by cluster
    values: torch.Tensor  # (n, dv) values, sorted by cluster
    counts: torch.Tensor  # (nc,)
    mean: torch.Tensor  # (nc, D)
    factor: torch.Tensor  # (nc, D, r)
    residual: torch.Tensor  # (nc, D)
    radius: torch.Tensor  # (nc, P)
    value_mean: torch.Tensor  # (nc, dv)
    value_cross: torch.Tensor  # (nc, D, dv)
    centroids: torch.Tensor  # (n_centroids, P) k-means centres in the concatenated lift space
    outlier_distance: torch.Tensor  # () keys this far from their centre join the outlier cluster
    group: torch.Tensor  # (nc,) the centre whose keys each cluster is a piece of (outliers: last)
    max_keys: torch.Tensor  # () the most trained keys a piece holds; 0: groups are never cut
    split_axis: torch.Tensor  # (n_splits, D) float64: each cut's direction in feature space
    split_threshold: torch.Tensor  # (n_splits,) float64: keys at or past it take the second side
    split_children: torch.Tensor  # (n_splits, 2) each side: a cut (>= 0) or piece p (-1 - p)
    group_root: torch.Tensor  # (n_groups,) each group's first cut, or its one piece, coded so

    # Of `to_bytes`; 1 kept a rank-r value factor instead of value_cross, 2 had no exact_read,
    # 3 no centroids, 4 no groups, 5 no cuts (each extend cut the groups again from all keys).
    FORMAT = 6

    @property
    def exact_read(self) -> torch.Tensor:
        """`(nc,)` bool: the clusters every query reads exactly (budget allowing), the pieces of
        the outlier group."""
        return self.group == self.centroids.shape[0]

    def positions(self, ids: torch.Tensor) -> torch.Tensor:
        """The sorted positions (rows of `keys_w` and `values`) of the key ids `ids`."""
        position = torch.empty_like(self.order)
        position[self.order] = torch.arange(self.n_keys, device=position.device)
        return position[ids]

    @property
    def n_keys(self) -> int:
        return self.order.shape[0]

    @property
    def n_clusters(self) -> int:
        return self.counts.shape[0]

    @property
    def rank(self) -> int:
        return self.factor.shape[-1]

    @property
    def nbytes(self) -> int:
        """Memory held by the representation's tensors."""
        return sum(
            getattr(self, field.name).nbytes for field in fields(self) if field.name != "geometry"
        )

    @classmethod
    @torch.no_grad()
    def build(
        cls,
        keys_w: torch.Tensor,
        values: torch.Tensor,
        geometry: Geometry,
        *,
        n_clusters: int | None = None,
        max_cluster_keys: int | None = None,
        rank: int = DEFAULT_RANK,
        outliers: float = DEFAULT_OUTLIERS,
        iterations: int = 10,
        seed: int = 0,
        probed_pieces: bool = True,
    ) -> KeyClusters:
        """Cluster key witnesses `(n, d_w)` (k-means on their concatenated lifts) and compute the
        statistics. `n_clusters` (k-means centres) defaults to ceil(n_t / 512) for the n_t
        trained keys; a centre's keys (its group) are cut into pieces of at most
        `max_cluster_keys` trained keys each (module docstring, "Pieces"): by default
        `default_cluster_keys(n_t)` when `n_clusters` is not given, never cut when it is.
        `rank` is the covariance basis size (capped at the feature dimension, which keeps the
        full covariance); the fraction `outliers` of the keys, those farthest from their
        cluster's centre, form one more cluster, which every query reads (module docstring).

        `probed_pieces` (on by default): where the default piece size applies, the trained
        keys' pieces are measured with some of those keys as queries, and halved where the
        tail estimate misses and halving mends it (`tail/probe.py`; docs/indexes.md, "Pieces
        sized by probes"); `False` keeps the default size on every head."""
        if keys_w.dim() != 2 or values.dim() != 2 or keys_w.shape[0] != values.shape[0]:
            raise ValueError(
                f"expected key witnesses (n, d) and values (n, dv) with the same n, got "
                f"{tuple(keys_w.shape)} and {tuple(values.shape)}"
            )
        check_clusterable(geometry)
        n = keys_w.shape[0]
        if n == 0:
            raise ValueError("cannot cluster an empty set of keys")
        prefix = trained_prefix(n)
        if max_cluster_keys is not None and max_cluster_keys < 0:
            raise ValueError(
                f"expected max_cluster_keys >= 1 (or 0: never cut), got {max_cluster_keys}"
            )
        given_clusters = bool(n_clusters)
        n_clusters = n_clusters or default_clusters(prefix)
        if not 1 <= n_clusters <= prefix:
            raise ValueError(
                f"expected 1 <= n_clusters <= {prefix} (the trained keys), got {n_clusters}"
            )
        if rank < 0:
            raise ValueError(f"expected rank >= 0, got {rank}")
        if not 0 <= outliers < 1:
            raise ValueError(f"expected outliers in [0, 1) (a fraction of keys), got {outliers}")
        # float64 stays float64 (the exactness tests); half precisions compute in float32.
        dtype = torch.float64 if keys_w.dtype == torch.float64 else torch.float32
        keys_w, values = keys_w.to(dtype), values.to(dtype)
        lifts = geometry.lift(keys_w, "key")
        features = key_features(lifts)
        probing = probed_pieces and max_cluster_keys is None and not given_clusters
        if max_cluster_keys is None:
            max_cluster_keys = (
                0
                if given_clusters
                else default_cluster_keys(prefix, features.shape[-1], values.shape[-1])
            )
        points = _points(lifts)
        centroids = kmeans(points[:prefix], n_clusters, iterations, seed)
        centroids = _refined(points[:prefix], centroids.to(keys_w.device, dtype))
        labels, distance = _nearest(points, centroids)
        n_outliers = int(outliers * prefix)
        outlier_distance = torch.tensor(math.inf, dtype=dtype, device=keys_w.device)
        n_groups = n_clusters
        if n_outliers > 0:
            outlier_distance = distance[:prefix].topk(n_outliers).values[-1]
            labels = labels.masked_fill(distance >= outlier_distance, n_clusters)
            n_groups += 1
        groups = _Groups(geometry, centroids, outlier_distance, labels, n_clusters, n_groups, rank)

        def cut(n_keys: int, max_keys: int) -> KeyClusters:
            return cls._cut(keys_w[:n_keys], values[:n_keys], features[:n_keys], groups, max_keys)

        if probing and prefix >= MIN_PROBED_KEYS and max_cluster_keys // 2 >= MIN_CLUSTER_KEYS:
            # Imported here: the tail package is built on this module.
            from .tail.probe import finer_pieces

            trained = finer_pieces(lambda max_keys: cut(prefix, max_keys), max_cluster_keys)
            if n == prefix:
                return trained
            max_cluster_keys = int(trained.max_keys)
        return cut(n, max_cluster_keys)

    @classmethod
    def _cut(
        cls,
        keys_w: torch.Tensor,
        values: torch.Tensor,
        features: torch.Tensor,
        groups: _Groups,
        max_keys: int,
    ) -> KeyClusters:
        """The representation of the keys `keys_w` `(n, d_w)` with `values` and `features`, the
        first `trained_prefix(n)` of them trained (their `groups`): each group cut into pieces
        of at most `max_keys` keys (0: never cut), then every piece's statistics."""
        prefix = trained_prefix(keys_w.shape[0])
        labels, n_groups = groups.labels[: keys_w.shape[0]], groups.n_groups
        trees, trained_piece = _PieceTrees.grown(
            features[:prefix], labels[:prefix], n_groups, max_keys, n_groups > groups.n_centres
        )
        piece = torch.cat([trained_piece, trees.pieces_of(features[prefix:], labels[prefix:])])
        trees, piece, _ = _cut_overfull(
            trees, piece, features.__getitem__, max_keys, groups.n_centres
        )
        order = piece.argsort(stable=True)  # by piece, ids ascending within each
        counts = torch.bincount(piece, minlength=trees.n_pieces)
        offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
        sorted_keys, sorted_values = _rows(keys_w, order), _rows(values, order)
        geometry = groups.geometry
        stats = _cluster_statistics(
            _rows(features, order),
            sorted_values,
            offsets,
            geometry.lift(sorted_keys[:1], "key"),
            groups.rank,
        )
        return cls(
            geometry=geometry,
            order=order,
            offsets=offsets,
            keys_w=sorted_keys,
            values=sorted_values,
            counts=counts.to(keys_w.dtype),
            centroids=groups.centroids,
            outlier_distance=groups.outlier_distance,
            max_keys=torch.tensor(max_keys),
            **trees.to(keys_w.device).fields(),
            **stats,
        )

    @torch.no_grad()
    def extend(self, keys_w: torch.Tensor, values: torch.Tensor, **build_options) -> KeyClusters:
        """The representation of these keys followed by `keys_w` `(m, d_w)` and `values`
        `(m, dv)`: equal to `build` over all of them, given the `build_options` this
        representation was built with (the rank is its own). The new keys are assigned to the
        trained centroids and down their group's cuts to a piece, and only the pieces they join
        are recomputed; when the trained prefix moves (`growth.retrains`), everything is built
        again with those options."""
        n_old, m = self.n_keys, keys_w.shape[0]
        if m == 0:
            return self
        keys_w, values = keys_w.to(self.keys_w.dtype), values.to(self.values.dtype)
        if retrains(n_old, n_old + m):
            all_keys = torch.empty_like(self.keys_w).index_copy_(0, self.order, self.keys_w)
            all_values = torch.empty_like(self.values).index_copy_(0, self.order, self.values)
            return type(self).build(
                torch.cat([all_keys, keys_w]),
                torch.cat([all_values, values]),
                self.geometry,
                **{"rank": self.rank, **build_options},
            )
        lifts = self.geometry.lift(keys_w, "key")
        new_piece = self._trees().pieces_of(key_features(lifts), self._assign(lifts))
        n_pieces = self.n_clusters
        gained = torch.bincount(new_piece, minlength=n_pieces).to(self.counts.dtype)
        max_keys = int(self.max_keys)
        if max_keys and ((self.counts + gained > max_keys) & ~self.exact_read).any():
            return self._with_cut_pieces(keys_w, values, new_piece)
        # Each new key goes at the end of its piece (after the old keys, in id order), which
        # keeps every piece's ids ascending.
        by_piece = new_piece.argsort(stable=True)
        at = self.offsets[new_piece[by_piece] + 1]
        new_ids = torch.arange(n_old, n_old + m, device=self.order.device)
        order = _inserted(self.order, new_ids[by_piece], at)
        sorted_keys = _inserted(self.keys_w, keys_w[by_piece], at)
        sorted_values = _inserted(self.values, values[by_piece], at)
        counts = self.counts + gained
        offsets = torch.cat([self.offsets.new_zeros(1), counts.long().cumsum(0)])
        touched = new_piece.unique()
        stats = self._piece_statistics(sorted_keys, sorted_values, offsets, touched)
        moments = {
            name: getattr(self, name).index_copy(0, touched, rows) for name, rows in stats.items()
        }
        return self._laid_out(order, sorted_keys, sorted_values, counts, **moments)

    def _with_cut_pieces(
        self, keys_w: torch.Tensor, values: torch.Tensor, new_piece: torch.Tensor
    ) -> KeyClusters:
        """`extend` where the new keys overfill pieces (`new_piece`: each one's piece): those
        are cut (`_cut_overfull`) and every key laid out again; the moments of the pieces that
        gained keys or were cut are recomputed, the others' kept."""
        n_pieces = self.n_clusters
        all_keys = torch.empty_like(self.keys_w).index_copy_(0, self.order, self.keys_w)
        all_values = torch.empty_like(self.values).index_copy_(0, self.order, self.values)
        all_keys, all_values = torch.cat([all_keys, keys_w]), torch.cat([all_values, values])
        sorted_piece = torch.repeat_interleave(
            torch.arange(n_pieces, device=self.order.device), self.offsets.diff()
        )
        piece = torch.empty_like(sorted_piece).index_copy_(0, self.order, sorted_piece)
        trees, piece, renumbered = _cut_overfull(
            self._trees(),
            torch.cat([piece, new_piece]),
            lambda ids: key_features(self.geometry.lift(all_keys[ids], "key")),
            int(self.max_keys),
            self.centroids.shape[0],
        )
        order = piece.argsort(stable=True)
        counts = torch.bincount(piece, minlength=trees.n_pieces)
        offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
        sorted_keys, sorted_values = _rows(all_keys, order), _rows(all_values, order)
        joined = torch.zeros(n_pieces, dtype=torch.bool, device=piece.device)
        joined[new_piece] = True
        cut_off = torch.ones(trees.n_pieces, dtype=torch.bool, device=piece.device)
        cut_off[renumbered] = False  # the second sides of the cuts: new pieces
        touched = cut_off.index_fill(0, renumbered[joined], True).nonzero().squeeze(-1)
        kept = (~joined).nonzero().squeeze(-1)
        stats = self._piece_statistics(sorted_keys, sorted_values, offsets, touched)
        moments = {}
        for name, rows in stats.items():
            old = getattr(self, name)
            moments[name] = (
                old.new_empty(trees.n_pieces, *old.shape[1:])
                .index_copy_(0, renumbered[kept], old[kept])
                .index_copy_(0, touched, rows)
            )
        return self._laid_out(
            order, sorted_keys, sorted_values, counts, **trees.fields(), **moments
        )

    def _laid_out(
        self,
        order: torch.Tensor,
        sorted_keys: torch.Tensor,
        sorted_values: torch.Tensor,
        counts: torch.Tensor,
        **changed: torch.Tensor,
    ) -> KeyClusters:
        """This representation with its keys laid out anew (`order`, the sorted keys and values,
        each piece's `counts`) and the `changed` fields replaced (`extend`)."""
        return replace(
            self,
            order=order,
            offsets=torch.cat([counts.new_zeros(1), counts.cumsum(0)]).long(),
            keys_w=sorted_keys,
            values=sorted_values,
            counts=counts.to(self.counts.dtype),
            **changed,
        )

    def _piece_statistics(
        self,
        sorted_keys: torch.Tensor,
        sorted_values: torch.Tensor,
        offsets: torch.Tensor,
        pieces: torch.Tensor,
    ) -> dict[str, torch.Tensor]:
        """The moments of `pieces` (rows in their order) of keys and values laid out by
        `offsets`."""
        rows = _ranges(offsets[pieces], offsets[pieces + 1])
        return _cluster_statistics(
            key_features(self.geometry.lift(sorted_keys[rows], "key")),
            sorted_values[rows],
            torch.cat([offsets.new_zeros(1), offsets.diff()[pieces].cumsum(0)]),
            self.geometry.lift(sorted_keys[:1], "key"),
            self.rank,
        )

    def _trees(self) -> _PieceTrees:
        """The cuts of every group into its pieces."""
        return _PieceTrees(
            self.split_axis, self.split_threshold, self.split_children, self.group_root,
            self.group,
        )  # fmt: skip

    def _assign(self, lifts: list[Lift]) -> torch.Tensor:
        """The group of each new key (its `lifts`): its nearest centroid, or the outlier group
        (numbered after the centroids) when it lies at least `outlier_distance` from it."""
        labels, distance = _nearest(_points(lifts), self.centroids)
        return labels.masked_fill(distance >= self.outlier_distance, self.centroids.shape[0])

    def to_bytes(self) -> bytes:
        """The representation (without the geometry) as an `.npz` archive."""
        buffer = io.BytesIO()
        arrays = {
            field.name: getattr(self, field.name).detach().cpu().numpy()
            for field in fields(self)
            if field.name != "geometry"
        }
        np.savez(buffer, format=np.array(self.FORMAT), **arrays)
        return buffer.getvalue()

    @classmethod
    def from_bytes(
        cls, data: bytes, geometry: Geometry, device: str | torch.device = "cpu"
    ) -> KeyClusters:
        """Load `to_bytes` output for the same geometry."""
        with np.load(io.BytesIO(data), allow_pickle=False) as archive:
            tensors = {name: torch.from_numpy(archive[name]).to(device) for name in archive.files}
        found = int(tensors.pop("format")) if "format" in tensors else 1
        if found != cls.FORMAT:
            raise ValueError(f"expected KeyClusters format {cls.FORMAT}, got format {found}")
        expected = {field.name for field in fields(cls)} - {"geometry"}
        if set(tensors) != expected:
            raise ValueError(f"expected arrays {sorted(expected)}, got {sorted(tensors)}")
        return cls(geometry=geometry, **tensors)


@dataclass
class ClusterHeads:
    """The clusters of several heads of one context (one `KeyClusters` each, one geometry), with
    the statistics the estimate reads stacked along a leading head axis, so that tail attention
    estimates and selects the clusters of every head in one pass
    (`rewa.index.tail.tail_attention_heads`).

    Heads with fewer clusters than the most are padded with empty clusters (count 0, every
    statistic 0): their estimate is `-inf` and no query selects them. One head's are views of
    its tensors, no copy; several heads' are copies (`nbytes`), which `stacked` makes once per
    version of the clusters."""

    heads: list[KeyClusters]
    counts: torch.Tensor  # (H, C)
    mean: torch.Tensor  # (H, C, D)
    factor_by_rank: torch.Tensor  # (H, D, r, C): the factors F_c, rank-major, as the estimate reads
    residual: torch.Tensor  # (H, C, D)
    radius: torch.Tensor  # (H, C, P)
    value_mean: torch.Tensor  # (H, C, dv)
    exact_read: torch.Tensor  # (H, C) bool
    # What a module derives from these clusters once and keeps with them, by the module's name
    # (the compiled decode step's arrays: index/tail/decode.py).
    derived: dict = field(default_factory=dict, compare=False, repr=False)

    # Not the value cross-covariances, most of the statistics' memory: the value shift reads
    # them per head from `heads`.
    STACKED = ("counts", "mean", "residual", "radius", "value_mean")

    @classmethod
    def stacked(cls, heads: list[KeyClusters]) -> ClusterHeads:
        if not heads:
            raise ValueError("expected the clusters of at least one head")
        geometry, n_keys = heads[0].geometry, heads[0].n_keys
        if any(clusters.geometry is not geometry for clusters in heads[1:]):
            raise ValueError("the heads' clusters must share one geometry object")
        if any(clusters.n_keys != n_keys for clusters in heads[1:]):
            sizes = [clusters.n_keys for clusters in heads]
            raise ValueError(f"the heads' clusters hold {sizes} keys, not one number of keys")
        if len(heads) == 1:
            (clusters,) = heads
            stats = {name: getattr(clusters, name).unsqueeze(0) for name in cls.STACKED}
            factor = clusters.factor.permute(1, 2, 0).unsqueeze(0)
            return cls(heads, **stats, factor_by_rank=factor, exact_read=clusters.exact_read[None])
        width = max(clusters.n_clusters for clusters in heads)
        stats = {}
        for name in (*cls.STACKED, "factor"):
            parts = [getattr(clusters, name) for clusters in heads]
            stack = parts[0].new_zeros(len(heads), width, *parts[0].shape[1:])
            for head, part in enumerate(parts):
                stack[head, : part.shape[0]] = part
            stats[name] = stack
        factor = stats.pop("factor").permute(0, 2, 3, 1).contiguous()
        exact_read = torch.zeros(len(heads), width, dtype=torch.bool, device=stats["mean"].device)
        for head, clusters in enumerate(heads):
            exact_read[head, : clusters.n_clusters] = clusters.exact_read
        return cls(heads, **stats, factor_by_rank=factor, exact_read=exact_read)

    @property
    def geometry(self) -> Geometry:
        return self.heads[0].geometry

    @property
    def n_heads(self) -> int:
        return len(self.heads)

    @property
    def n_clusters(self) -> int:
        """Clusters per head, the padding included."""
        return self.counts.shape[1]

    @property
    def rank(self) -> int:
        return self.factor_by_rank.shape[2]

    @property
    def head_clusters(self) -> list[int]:
        """Each head's clusters, without the padding."""
        return [clusters.n_clusters for clusters in self.heads]

    @property
    def nbytes(self) -> int:
        """Memory of the stacked statistics (0 for one head: views)."""
        if len(self.heads) == 1:
            return 0
        stacked = [getattr(self, name) for name in (*self.STACKED, "factor_by_rank", "exact_read")]
        return sum(tensor.nbytes for tensor in stacked)


def kmeans(points: torch.Tensor, n_clusters: int, iterations: int, seed: int) -> torch.Tensor:
    """The k-means centroids `(n_clusters, P)` of `points` (float32, on the points' device):
    `index/kmeans.py`, FAISS's k-means step by step with its random draws (the same centroids
    as `faiss.Kmeans` up to float rounding) on a sample of 64 points per centre; one centre is
    the mean of every point (docs/indexes.md, "IVF lists trained in PyTorch")."""
    if n_clusters == 1:
        return points.detach().to(torch.float32).mean(0, keepdim=True)
    return torch_kmeans(points, n_clusters, iterations, seed, max_points_per_centroid=64)


def _points(lifts: list[Lift]) -> torch.Tensor:
    """The points k-means clusters: every lift's vectors, concatenated."""
    return torch.cat([lift.vectors for lift in lifts], dim=-1)


def _refined(points: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """One Lloyd step over all `points`: each centroid moved to the mean of the points nearest
    to it (kept where none is). k-means trains on a sample of 64 points per centroid; after
    this step the centroids are (close to) their clusters' means over every trained key, which
    the outlier distance is measured from."""
    return cluster_means(points, nearest_centroids(points, centroids), centroids)


def _nearest(points: torch.Tensor, centroids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each point's nearest centroid `(n,)` (exact, from float32 matrix products on the points'
    device, `kmeans.nearest`) and its Euclidean distance to it `(n,)` in the points' dtype.
    On the CPU these products find the same centroids as FAISS's flat search, about 3x faster
    (docs/benchmark-notes.md, "The tail build's nearest centres by PyTorch products
    (issue 23)")."""
    labels = nearest_centroids(points, centroids)
    return labels, _distances(points, centroids, labels)


# Points per block of `_distances` (temporaries of tens of megabytes, not of every point).
DISTANCE_ROWS = 65536


def _distances(points: torch.Tensor, centroids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each point's Euclidean distance `(n,)` to the centroid its label names, in the points'
    dtype, in blocks of `DISTANCE_ROWS` points: one block of a million points was slower
    (docs/benchmark-notes.md, "Measurements behind code choices")."""
    return torch.cat([
        (points[start : start + DISTANCE_ROWS] - centroids[labels[start : start + DISTANCE_ROWS]])
        .norm(dim=-1)
        for start in range(0, max(len(points), 1), DISTANCE_ROWS)
    ])  # fmt: skip


def _cluster_statistics(
    features: torch.Tensor,
    values: torch.Tensor,
    offsets: torch.Tensor,
    lifts: list[Lift],
    rank: int,
) -> dict[str, torch.Tensor]:
    """Per-cluster moments of sorted features `(n, D)` and values `(n, dv)`, computed in their
    dtype (float32 or float64) for batches of clusters of similar size (`_batch_statistics`)."""
    n_clusters, dim, value_dim = len(offsets) - 1, features.shape[-1], values.shape[-1]
    rank = min(rank, dim)
    blocks = _lift_blocks(lifts)
    like = features.new_zeros
    stats = {
        "mean": like(n_clusters, dim),
        "factor": like(n_clusters, dim, rank),
        "residual": like(n_clusters, dim),
        "radius": like(n_clusters, len(blocks)),
        "value_mean": like(n_clusters, value_dim),
        "value_cross": like(n_clusters, dim, value_dim),
    }
    counts = offsets.diff()
    # Each cluster's rows are padded to the power of two at or above its count, and a batch holds
    # clusters of one padded length: a cluster's moments are then computed by the same
    # operations whatever else is in its batch, so they come out the same bit for bit in a
    # build and in an extend (docs/indexes.md, "Appends").
    padded = torch.where(counts > 1, 2 ** torch.ceil(torch.log2(counts.clamp_min(1).double())), 1)
    padded = padded.long()
    by_size = padded.argsort(stable=True)
    lengths = padded[by_size].tolist()
    per_cluster = dim * dim + dim * value_dim  # the covariances' elements
    begin = 0
    while begin < n_clusters:
        length, end = lengths[begin], begin + 1
        while (
            end < n_clusters
            and lengths[end] == length
            and (end + 1 - begin) * (length * (dim + value_dim) + per_cluster)
            <= STATISTICS_BATCH_ELEMENTS
        ):
            end += 1
        batch = by_size[begin:end]
        found = _batch_statistics(
            features, values, offsets[batch], counts[batch], length, blocks, rank
        )
        for name, rows in found.items():
            stats[name][batch] = rows
        begin = end
    return stats


def _batch_statistics(
    features: torch.Tensor,
    values: torch.Tensor,
    first: torch.Tensor,
    counts: torch.Tensor,
    length: int,
    blocks: list[slice],
    rank: int,
) -> dict[str, torch.Tensor]:
    """The moments of the clusters whose keys are rows `first[c] : first[c] + counts[c]` of the
    sorted features and values: the clusters' rows gathered into one `(nb, length, D)` batch
    padded with zeros, centred before their products."""
    position = torch.arange(length, device=features.device)
    present = (position < counts.unsqueeze(-1)).unsqueeze(-1)  # (nb, longest, 1)
    rows = (first.unsqueeze(-1) + position).clamp_max(features.shape[0] - 1)
    size = counts.clamp_min(1).to(features.dtype).reshape(-1, 1, 1)
    b = _rows(features, rows) * present
    v = _rows(values, rows) * present
    mu, m = b.sum(1, keepdim=True) / size, v.sum(1, keepdim=True) / size
    centred, centred_v = (b - mu) * present, (v - m) * present
    covariance = centred.transpose(1, 2) @ centred / size
    eigenvalues, top = _leading_eigh(covariance, rank)  # ascending
    # An eigenvector's sign is arbitrary; fixed (its largest component positive) so that the
    # same cluster gets the same factor in any batch.
    top = top * top.gather(1, top.abs().argmax(1, keepdim=True)).sign()
    factor = top * eigenvalues[:, None, :].clamp_min(0).sqrt()
    left_out = covariance.diagonal(dim1=-2, dim2=-1) - factor.square().sum(-1)
    return {
        "mean": mu.squeeze(1),
        "factor": factor,
        "residual": left_out.clamp_min(0),
        "radius": torch.stack([centred[..., s].norm(dim=-1).amax(1) for s in blocks], -1),
        "value_mean": m.squeeze(1),
        "value_cross": centred.transpose(1, 2) @ centred_v / size,
    }


# Subspace iteration for a covariance's leading eigenpairs (`_leading_eigh`): a basis of twice
# the rank, multiplied by the covariance this many times (docs/benchmark-notes.md, "A faster
# tail build (issue 25)").
SUBSPACE_STEPS = 8


def _leading_eigh(covariance: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `rank` leading eigenpairs of a batch of covariances `(nb, D, D)`: eigenvalues
    `(nb, rank)` ascending and unit eigenvectors `(nb, D, rank)`.

    Where twice the rank is less than D, by subspace iteration: a fixed orthonormal basis of
    `2 rank` columns (seeded, the same for every cluster) is multiplied by the covariance
    `SUBSPACE_STEPS` times, orthonormalised after each product, and the covariance projected
    on it is solved by `_eigh` (its Rayleigh-Ritz pairs). Each product costs `D^2 2 rank`
    against the `D^3` of a full solve: at D = 64-128 the full solve took most of the
    statistics' time. Otherwise (and at rank 0) the full `_eigh`. Either way each covariance
    is solved by operations of its own, so a cluster's answer does not depend on its batch."""
    dim = covariance.shape[-1]
    width = 2 * rank
    if rank == 0 or width >= dim:
        eigenvalues, eigenvectors = _eigh(covariance)
        return eigenvalues[:, dim - rank :], eigenvectors[..., dim - rank :]
    trace = covariance.diagonal(dim1=-2, dim2=-1).sum(-1)
    scale = torch.where(trace > 0, torch.exp2(torch.log2(trace).round()), torch.ones_like(trace))
    scaled = covariance / scale[:, None, None]
    generator = torch.Generator().manual_seed(0)
    start = torch.randn(dim, width, generator=generator, dtype=torch.float64)
    basis = torch.linalg.qr(start).Q.to(covariance.device, covariance.dtype)
    basis = basis.expand(covariance.shape[0], dim, width)
    for _ in range(SUBSPACE_STEPS):
        basis = torch.linalg.qr(scaled @ basis).Q
    eigenvalues, eigenvectors = _eigh(basis.transpose(1, 2) @ scaled @ basis)
    top = basis @ eigenvectors[..., width - rank :]
    return eigenvalues[:, width - rank :] * scale[:, None], top


def _eigh(covariance: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`torch.linalg.eigh` of a batch of covariances `(nb, D, D)`, each scaled first by the
    power of two nearest its trace (exact, so the answer is the same for a cluster in any
    batch), one by one where the solver gives up on the batch (`_eigh_each`), and with zero
    eigenvalues and the identity for one whose answer is still not finite.

    LAPACK's float32 solver returned NaN eigenvectors for the covariance of 12 identical keys
    (MiniLM's layer 0), whose entries are rounding noise of about 1e-14; that cluster's factor
    and residual were NaN, and so was every output of a query that estimated it
    (tests/test_tail.py, `test_a_cluster_of_identical_keys_has_finite_statistics`)."""
    trace = covariance.diagonal(dim1=-2, dim2=-1).sum(-1)
    scale = torch.where(trace > 0, torch.exp2(torch.log2(trace).round()), torch.ones_like(trace))
    scaled = covariance / scale[:, None, None]
    try:
        eigenvalues, eigenvectors = torch.linalg.eigh(scaled)
    except torch.linalg.LinAlgError:
        eigenvalues, eigenvectors = _eigh_each(scaled)
    eigenvalues = eigenvalues * scale[:, None]
    failed = ~(torch.isfinite(eigenvalues).all(-1) & torch.isfinite(eigenvectors).all((-2, -1)))
    if failed.any():
        identity = torch.eye(covariance.shape[-1], dtype=covariance.dtype, device=covariance.device)
        eigenvalues = eigenvalues.masked_fill(failed[:, None], 0)
        eigenvectors = torch.where(failed[:, None, None], identity, eigenvectors)
    return eigenvalues, eigenvectors


def _eigh_each(matrices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`torch.linalg.eigh` of each matrix of a batch `(nb, D, D)` on its own, for a batch on
    which the solver raised: a matrix it gives up on again is solved in float64 (then rounded
    back), and one it gives up on in float64 too answers NaN (`_eigh` replaces it). The others'
    answers are the batch's (the batched solver solves each matrix as it does alone), so a
    cluster's statistics do not depend on the clusters it was built with.

    MKL's float32 solver gave up on the covariance of a MiniLM cluster whose keys took two
    values (rank one, entries powers of two; benchmarks/minilm_layers.py stopped on it,
    tests/test_tail.py `test_a_rank_one_covariance_the_float32_solver_gives_up_on`)."""
    values, vectors = [], []
    for matrix in matrices:
        try:
            found = torch.linalg.eigh(matrix)
        except torch.linalg.LinAlgError:
            try:
                found = tuple(t.to(matrix.dtype) for t in torch.linalg.eigh(matrix.double()))
            except torch.linalg.LinAlgError:
                found = (
                    matrix.new_full(matrix.shape[:1], torch.nan),
                    torch.full_like(matrix, torch.nan),
                )
        values.append(found[0])
        vectors.append(found[1])
    return torch.stack(values), torch.stack(vectors)


def _lift_blocks(lifts: list[Lift]) -> list[slice]:
    """Each lift's block of the feature vector."""
    slices, start = [], 0
    for lift in lifts:
        width = lift.vectors.shape[-1] + (1 if lift.metric == "l2" else 0)
        slices.append(slice(start, start + width))
        start += width
    return slices


@dataclass
class _PieceTrees:
    """Every group's cuts into pieces (module docstring, "Pieces"), as `KeyClusters` keeps them:
    a cut sends a key with features `b` to its second side when `<b, axis> >= threshold`, to
    its first otherwise; a side is another cut (>= 0) or piece p (coded -1 - p). In canonical
    order (`canonical`) cuts and pieces are numbered group by group, depth first, first sides
    first."""

    axis: torch.Tensor  # (n_splits, D) float64
    threshold: torch.Tensor  # (n_splits,) float64
    children: torch.Tensor  # (n_splits, 2)
    root: torch.Tensor  # (n_groups,)
    group: torch.Tensor  # (n_pieces,) each piece's group

    @property
    def n_pieces(self) -> int:
        return self.group.shape[0]

    @classmethod
    def grown(
        cls,
        features: torch.Tensor,
        labels: torch.Tensor,
        n_groups: int,
        max_keys: int,
        last_whole: bool,
    ) -> tuple[_PieceTrees, torch.Tensor]:
        """The cuts of the trained keys' `features` `(n_t, D)` in their groups `labels`, and
        each trained key's piece `(n_t,)` in them (what `pieces_of` finds for these keys, without
        walking them down the cuts again): a set of more than `max_keys` keys (0: none is cut)
        is cut across its principal axis where ceil(m / max_keys) pieces in all still suffice
        (`_splits`), and each part cut again; the sets of one depth are cut in one batch. The
        last group stays whole when `last_whole` (the outliers). Cuts and pieces are numbered
        depth by depth (`canonical` puts them in order)."""
        axes, thresholds, children, pieces_group = [], [], [], []
        piece = torch.empty_like(labels)
        roots = [0] * n_groups

        def hang(place: tuple[int | None, int], code: int) -> None:
            node, side = place  # (None, group): a group's root
            if node is None:
                roots[side] = code
            else:
                children[node][side] = code

        grouped = labels.argsort(stable=True)
        sizes = torch.bincount(labels, minlength=n_groups).tolist()
        # Sets of keys still to place: (rows, group, where they hang, whether they may be cut),
        # one level of the trees at a time, every set of a level cut in one batch.
        pending = [
            (rows, label, (None, label), not (last_whole and label == n_groups - 1))
            for label, rows in enumerate(grouped.split(sizes))
        ]
        while pending:
            cuttable = [i for i, (*_, may_cut) in enumerate(pending) if may_cut and max_keys]
            found = _splits(features, [pending[i][0] for i in cuttable], max_keys)
            splits = dict(zip(cuttable, found, strict=True))
            next_level = []
            for i, (rows, label, place, _) in enumerate(pending):
                split = splits.get(i)
                if split is None:
                    piece[rows] = len(pieces_group)
                    pieces_group.append(label)
                    hang(place, -len(pieces_group))  # piece len - 1
                    continue
                axis, threshold, second = split
                node = len(axes)
                axes.append(axis)
                thresholds.append(threshold)
                children.append([0, 0])
                hang(place, node)
                next_level.append((rows[~second], label, (node, 0), True))
                next_level.append((rows[second], label, (node, 1), True))
            pending = next_level
        dim = features.shape[-1]
        trees = cls(
            axis=torch.stack(axes) if axes else torch.zeros(0, dim, dtype=torch.float64),
            threshold=torch.tensor(thresholds, dtype=torch.float64),
            children=torch.tensor(children, dtype=torch.long).reshape(-1, 2),
            root=torch.tensor(roots, dtype=torch.long),
            group=torch.tensor(pieces_group, dtype=torch.long),
        )
        return trees.to(features.device), piece

    def to(self, device: torch.device) -> _PieceTrees:
        return _PieceTrees(
            **{field.name: getattr(self, field.name).to(device) for field in fields(self)}
        )

    def fields(self) -> dict[str, torch.Tensor]:
        """The trees as `KeyClusters` fields."""
        return {
            "group": self.group,
            "split_axis": self.axis,
            "split_threshold": self.threshold,
            "split_children": self.children,
            "group_root": self.root,
        }

    def pieces_of(self, features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The piece `(m,)` of keys with `features` `(m, D)` in groups `labels` `(m,)`."""
        code = self.root[labels]
        while True:
            at = (code >= 0).nonzero().squeeze(-1)
            if len(at) == 0:
                return -1 - code
            node = code[at]
            projection = (features[at].double() * self.axis[node]).sum(-1)
            code[at] = self.children[node, (projection >= self.threshold[node]).long()]

    def split_overfull(
        self,
        members: dict[int, torch.Tensor],
        features_of: Callable[[torch.Tensor], torch.Tensor],
        max_keys: int,
    ) -> tuple[_PieceTrees, list[tuple[int, torch.Tensor]]]:
        """These trees with each piece of `members` (its key ids, ascending, more than
        `max_keys`) cut in two across the principal axis of its first `max_keys + 1` keys,
        and each side cut again the same way while it holds too many; and the new pieces with
        their members. Which keys a cut is drawn from depends on the piece's keys alone, so
        pieces cut as they fill, appends at a time, are the pieces cut at once. `features_of`
        gives the features `(m, D)` of key ids. New cuts and pieces are numbered after the
        others (`canonical` puts them in place)."""
        axes, thresholds = list(self.axis), self.threshold.tolist()
        children, roots, groups = self.children.tolist(), self.root.tolist(), self.group.tolist()
        parent = {}  # piece -> (cut, side) or (None, group) where it hangs
        for node, sides in enumerate(children):
            for side, code in enumerate(sides):
                if code < 0:
                    parent[-1 - code] = (node, side)
        for label, code in enumerate(roots):
            if code < 0:
                parent[-1 - code] = (None, label)
        pieces = []

        def hang(piece: int, code: int) -> None:
            node, where = parent[piece]
            if node is None:
                roots[where] = code
            else:
                children[node][where] = code

        def cut(piece: int, ids: torch.Tensor) -> None:
            features = features_of(ids).double() if len(ids) > max_keys else None
            split = None if features is None else _split(features[: max_keys + 1], max_keys)
            if split is None:
                pieces.append((piece, ids))
                return
            axis, threshold, _ = split
            node = len(axes)
            axes.append(axis)
            thresholds.append(float(threshold))
            second_piece = len(groups)
            groups.append(groups[piece])
            children.append([-1 - piece, -1 - second_piece])
            hang(piece, node)
            parent[piece], parent[second_piece] = (node, 0), (node, 1)
            second = (features * axis).sum(-1) >= threshold  # as `pieces_of`
            cut(piece, ids[~second])
            cut(second_piece, ids[second])

        for piece, ids in sorted(members.items()):
            cut(piece, ids)
        device = self.root.device
        trees = _PieceTrees(
            axis=torch.stack(axes) if axes else self.axis,
            threshold=torch.tensor(thresholds, dtype=torch.float64, device=device),
            children=torch.tensor(children, dtype=torch.long, device=device).reshape(-1, 2),
            root=torch.tensor(roots, dtype=torch.long, device=device),
            group=torch.tensor(groups, dtype=torch.long, device=device),
        )
        return trees, pieces

    def canonical(self) -> tuple[_PieceTrees, torch.Tensor]:
        """These trees with cuts and pieces numbered in canonical order, and the new number of
        each piece `(n_pieces,)`."""
        children = self.children.tolist()
        node_order, piece_order = [], []

        def visit(code: int) -> int:
            if code < 0:
                piece_order.append(-1 - code)
                return -len(piece_order)
            node_order.append(code)
            at = len(node_order) - 1
            sides = [visit(side) for side in children[code]]
            new_children[at] = sides
            return at

        new_children: dict[int, list[int]] = {}
        roots = [visit(code) for code in self.root.tolist()]
        device = self.root.device
        renumbered = torch.empty(self.n_pieces, dtype=torch.long, device=device)
        renumbered[torch.tensor(piece_order, dtype=torch.long, device=device)] = torch.arange(
            len(piece_order), device=device
        )
        nodes = torch.tensor(node_order, dtype=torch.long, device=device)
        trees = _PieceTrees(
            axis=self.axis[nodes],
            threshold=self.threshold[nodes],
            children=torch.tensor(
                [new_children[at] for at in range(len(node_order))], dtype=torch.long, device=device
            ).reshape(-1, 2),
            root=torch.tensor(roots, dtype=torch.long, device=device),
            group=self.group[torch.tensor(piece_order, dtype=torch.long, device=device)],
        )
        return trees, renumbered


def _cut_overfull(
    trees: _PieceTrees,
    piece: torch.Tensor,
    features_of: Callable[[torch.Tensor], torch.Tensor],
    max_keys: int,
    whole_group: int,
) -> tuple[_PieceTrees, torch.Tensor, torch.Tensor]:
    """`(trees, piece, renumbered)`: the `trees` with every piece of more than `max_keys` keys
    (`piece`: each key's; pieces of group `whole_group`, the outliers, apart) cut as it would
    have been while filling (`_PieceTrees.split_overfull`), in canonical order; each key's
    piece in them; and the new number of each piece of `trees`."""
    n_before = trees.n_pieces
    if max_keys:
        counts = torch.bincount(piece, minlength=trees.n_pieces)
        overfull = (counts > max_keys) & (trees.group != whole_group)
        if overfull.any():
            members = dict(
                zip(
                    range(trees.n_pieces),
                    piece.argsort(stable=True).split(counts.tolist()),
                    strict=True,
                )
            )
            wanted = {p: members[p] for p in overfull.nonzero().squeeze(-1).tolist()}
            trees, cut = trees.split_overfull(wanted, features_of, max_keys)
            piece = piece.clone()
            for new, ids in cut:
                piece[ids] = new
    trees, renumbered = trees.canonical()
    return trees, renumbered[piece], renumbered[:n_before]


def _split(
    features: torch.Tensor, max_keys: int
) -> tuple[torch.Tensor, float, torch.Tensor] | None:
    """How to cut one set of keys with `features` `(m, D)` in two (`_splits`)."""
    return _splits(features, [torch.arange(features.shape[0], device=features.device)], max_keys)[0]


# Elements (sets x keys x features) of one batch of `_splits` (docs/benchmark-notes.md,
# "Measurements behind code choices").
SPLIT_BATCH_ELEMENTS = 1 << 20


def _splits(
    features: torch.Tensor, sets: list[torch.Tensor], max_keys: int
) -> list[tuple[torch.Tensor, float, torch.Tensor] | None]:
    """How to cut each set of keys (the rows `sets[i]` of `features` `(n, D)`) in two: its
    principal axis, the threshold between two consecutive projections where the gap times the
    keys on the smaller side is largest, among the places that leave ceil(m / max_keys) pieces
    in all (docs/mathematics.md 6, "Pieces"), and which of its keys take the second side (`<b,
    axis> >= threshold`, as `_PieceTrees.pieces_of` sends them); None when the set fits or
    cannot be cut (every projection equal). Computed in float64, for batches of sets of about
    `SPLIT_BATCH_ELEMENTS` padded elements at a time."""
    answers: list[tuple[torch.Tensor, float, torch.Tensor] | None] = [None] * len(sets)
    by_size = sorted((i for i, rows in enumerate(sets) if len(rows) > max_keys),
                     key=lambda i: len(sets[i]))  # fmt: skip
    while by_size:
        batch = [by_size.pop()]  # the largest left, then as many as fit beside it
        width = len(sets[batch[0]]) * features.shape[1]
        while by_size and (len(batch) + 1) * width <= SPLIT_BATCH_ELEMENTS:
            batch.append(by_size.pop())
        cuts = _split_batch(features, [sets[i] for i in batch], max_keys)
        for i, answer in zip(batch, cuts, strict=True):
            answers[i] = answer
    return answers


def _split_batch(
    features: torch.Tensor, sets: list[torch.Tensor], max_keys: int
) -> list[tuple[torch.Tensor, float, torch.Tensor] | None]:
    """`_splits` for sets of more than `max_keys` keys, padded into one batch `(B, M, D)`."""
    device = features.device
    m = torch.tensor([len(rows) for rows in sets], device=device)
    width = int(m.max())
    valid = torch.arange(width, device=device) < m.unsqueeze(-1)  # (B, M)
    index = torch.zeros(len(sets), width, dtype=torch.long, device=device)
    index[valid] = torch.cat(sets)
    dtype = features.dtype
    features = _rows(features, index).double().masked_fill(~valid.unsqueeze(-1), 0.0)
    mean = features.sum(1) / m.unsqueeze(-1)
    centred = (features - mean.unsqueeze(1)) * valid.unsqueeze(-1)
    # The axis is a direction: found in the keys' own dtype (float32 products are about twice
    # as fast), then made a float64 unit vector, which the projections below and
    # `_PieceTrees.pieces_of` share (docs/benchmark-notes.md, "A faster tail build (issue 25)").
    axis = _principal_axes(centred.to(dtype)).double()  # (B, D)
    axis = axis / axis.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(axis.dtype).tiny)
    projection = (features * axis.unsqueeze(1)).sum(-1)  # as `_PieceTrees.pieces_of`
    ascending = projection.masked_fill(~valid, math.inf).sort(-1).values
    # Place i (1 <= i < m) cuts between ascending[i - 1] and ascending[i].
    place = torch.arange(1, width, device=device)
    gap = ascending[:, 1:] - ascending[:, :-1]
    inside = place < m.unsqueeze(-1)
    step = inside & (gap > 0)
    # Among the places that cut the set into no more pieces than ceil(m / max_keys) in all,
    # where the keys' projections leave a wide gap with many keys on both sides (the gap times
    # the smaller side): between natural groups of keys, not through one, and not off a tail.
    n_pieces = -(-m // max_keys)
    low, high = m - (n_pieces - 1) * max_keys, (n_pieces - 1) * max_keys
    allowed = step & (place >= low.unsqueeze(-1)) & (place <= high.unsqueeze(-1))
    balance = torch.minimum(place, m.unsqueeze(-1) - place)
    best = (gap * balance).masked_fill(~allowed, -math.inf).argmax(-1)
    # Where no place is allowed, the step nearest an even split into the pieces.
    wanted = m * (n_pieces // 2) // n_pieces
    nearest = (place - wanted.unsqueeze(-1)).abs().masked_fill(~step, width).argmin(-1)
    at = torch.where(allowed.any(-1), best, nearest) + 1
    rows = torch.arange(len(sets), device=device)
    threshold = (ascending[rows, at - 1] + ascending[rows, at]) / 2
    second = projection >= threshold.unsqueeze(-1)
    can_cut = step.any(-1).tolist()
    return [
        (axis[b], float(threshold[b]), second[b, : len(sets[b])]) if can_cut[b] else None
        for b in range(len(sets))
    ]


def _inserted(rows: torch.Tensor, new: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """`rows` with `new` inserted: new row i just before old row `at[i]` (`at` ascending; the
    number of rows: at the end), by slices, not by a gather."""
    places, runs = torch.unique_consecutive(at, return_counts=True)
    parts, previous, taken = [], 0, 0
    for place, run in zip(places.tolist(), runs.tolist(), strict=True):
        parts += [rows[previous:place], new[taken : taken + run]]
        previous, taken = place, taken + run
    parts.append(rows[previous:])
    if rows.device.type != "cpu":
        return torch.cat(parts)
    # numpy's allocator asks the kernel for huge pages for large arrays, which makes this copy
    # about twice as fast as torch.cat's (docs/benchmark-notes.md,
    # "Appends and builds of the clustered tail (issue 23)").
    return torch.from_numpy(np.concatenate([part.numpy() for part in parts]))


def _rows(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`table[index]` for an integer `index` of any shape: the rows of `table` `(n, ...)` at
    `index`, `(*index.shape, ...)`. By `index_select`, which gathered a million rows of 64
    floats in half the time of indexing on the CPU (docs/benchmark-notes.md, "A faster tail
    build (issue 25)")."""
    return table.index_select(0, index.reshape(-1)).view(*index.shape, *table.shape[1:])


def _ranges(begin: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
    """The concatenated integer ranges `[begin[i], end[i])`."""
    lengths = end - begin
    starts = torch.repeat_interleave(
        begin - torch.cat([lengths.new_zeros(1), lengths.cumsum(0)[:-1]]), lengths
    )
    return starts + torch.arange(int(lengths.sum()), device=begin.device)


def _principal_axes(centred: torch.Tensor, steps: int = 8) -> torch.Tensor:
    """The direction of largest variance of each batch of centred rows `(B, m, D)` (rows of
    zeros pad a batch without changing it), by power iteration on the rows' scatter matrix
    started at the row farthest from the mean: unit vectors `(B, D)`, zero where every row is
    0."""
    start = centred.square().sum(-1).argmax(-1)
    axis = centred[torch.arange(centred.shape[0], device=centred.device), start]
    scatter = torch.bmm(centred.transpose(1, 2), centred)  # (B, D, D)
    for _ in range(steps):
        axis = torch.bmm(scatter, axis.unsqueeze(-1))[..., 0]
        axis = axis / axis.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(axis.dtype).tiny)
    return axis


def default_cluster_keys(n_keys: int, feature_dim: int, value_dim: int) -> int:
    """The default `max_cluster_keys` for `n_keys` trained keys with features `(., feature_dim)`
    and values `(., value_dim)` (module docstring, "Pieces"): `n_keys / 512` within [32, 256],
    raised to the size whose key-value cross-covariance (`feature_dim x value_dim`, read for
    every query) is no more than 1/8 of the keys and values it summarises."""
    by_count = min(
        DEFAULT_MAX_CLUSTER_KEYS, max(MIN_CLUSTER_KEYS, n_keys // DEFAULT_KEYS_PER_CLUSTER)
    )
    by_summary = -(-SUMMARY_RATIO * feature_dim * value_dim // (feature_dim + value_dim))
    return max(by_count, by_summary)


def default_clusters(n_keys: int) -> int:
    """The default number of clusters for `n_keys` keys."""
    return max(1, math.ceil(n_keys / DEFAULT_KEYS_PER_CLUSTER))
