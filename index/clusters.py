"""The clustered representation of a context's keys behind cluster-tail attention
(docs/mathematics.md 6, "Tail estimate").

Keys are partitioned by k-means (FAISS, on the GPU when one is usable) on their exact lift
vectors. Every estimate works in *feature space*: the lift similarity of a query and a key
(`rewa.attention.geometry.lift_similarity`) is affine in a key feature vector `b(k)`,
`s = <a(q), b(k)> + c(q)`, per lift:

- inner-product lift `(x_q, x_k)`: `a = x_q`, `b = x_k`, `c = 0`;
- L2 lift: `s = -|x_q - x_k|^2`, so `a = (2 x_q, -1)`, `b = (x_k, |x_k|^2)`, `c = -|x_q|^2`.

A geometry's logit is a function of these similarities (`Geometry.similarity_logits`), so the
first two moments of each cluster's features determine the mean and variance of every query's
similarities to the cluster's keys exactly. Per cluster c the representation keeps:

- `counts` n_c, the feature `mean` mu_c, and `radius` (per lift): the largest `|b - mu_c|`,
  which bounds every similarity to `s_bar +- |a| radius`;
- the feature covariance `Sigma_c ~ F_c F_c^T + diag(residual_c)`: `factor` F_c = U_c
  Lambda_c^(1/2) (D x r) from its top r eigenpairs, `residual` the diagonal of what they leave
  out; `rank = D` keeps the full covariance;
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

k-means trains on the first `growth.trained_prefix(n)` keys and every key is assigned to the
nearest centroid, so `extend` (appended keys: assigned, and only the clusters they join
recomputed) gives the representation `build` gives over the same keys (docs/indexes.md).

`to_bytes` / `from_bytes` serialise everything but the geometry (numpy `.npz`, no pickle).
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass, fields

import numpy as np
import torch

from rewa.attention import Geometry, Lift

from .faiss_index import faiss, faiss_device
from .growth import retrains, trained_prefix

DEFAULT_RANK = 4
DEFAULT_KEYS_PER_CLUSTER = 512
DEFAULT_OUTLIERS = 0.001


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
    exact_read: torch.Tensor  # (nc,) bool: read exactly by every query (budget allowing)
    centroids: torch.Tensor  # (n_centroids, P) k-means centres in the concatenated lift space
    outlier_distance: torch.Tensor  # () keys this far from their centre join the outlier cluster

    # Of `to_bytes`; 1 kept a rank-r value factor instead of value_cross, 2 had no exact_read,
    # 3 no centroids.
    FORMAT = 4

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
        rank: int = DEFAULT_RANK,
        outliers: float = DEFAULT_OUTLIERS,
        iterations: int = 10,
        seed: int = 0,
        device: str | None = None,
    ) -> KeyClusters:
        """Cluster key witnesses `(n, d_w)` (k-means on their concatenated lifts) and compute the
        statistics. `n_clusters` defaults to ceil(n / 512); `rank` is the covariance basis size
        (capped at the feature dimension, which keeps the full covariance); the fraction
        `outliers` of the keys, those farthest from their cluster's centre, form one more
        cluster, which every query reads (module docstring)."""
        if keys_w.dim() != 2 or values.dim() != 2 or keys_w.shape[0] != values.shape[0]:
            raise ValueError(
                f"expected key witnesses (n, d) and values (n, dv) with the same n, got "
                f"{tuple(keys_w.shape)} and {tuple(values.shape)}"
            )
        if not geometry.exact_lift:
            raise ValueError(
                f"cluster attention estimates logits from lift similarities, which "
                f"{type(geometry).__name__} does not have (no exact lift); use an IVF, HNSW, "
                f"flat or LSH index (topk) or dense attention"
            )
        n = keys_w.shape[0]
        if n == 0:
            raise ValueError("cannot cluster an empty set of keys")
        prefix = trained_prefix(n)
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
        points = _points(geometry.lift(keys_w, "key"))
        centroids = kmeans(points[:prefix], n_clusters, iterations, seed, device)
        centroids = _refined(points[:prefix], centroids.to(keys_w.device, dtype))
        labels, distance = _nearest(points, centroids)
        n_outliers = int(outliers * prefix)
        outlier_distance = torch.tensor(math.inf, dtype=dtype, device=keys_w.device)
        exact_read = torch.zeros(n_clusters, dtype=torch.bool, device=keys_w.device)
        if n_outliers > 0:
            outlier_distance = distance[:prefix].topk(n_outliers).values[-1]
            labels = labels.masked_fill(distance >= outlier_distance, n_clusters)
            exact_read = torch.cat([exact_read, exact_read.new_ones(1)])
        order = labels.argsort(stable=True)
        counts = torch.bincount(labels, minlength=len(exact_read))
        offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
        sorted_keys, sorted_values = keys_w[order], values[order]
        stats = _cluster_statistics(
            key_features(geometry.lift(sorted_keys, "key")),
            sorted_values,
            offsets,
            geometry.lift(sorted_keys[:1], "key"),
            rank,
        )
        return cls(
            geometry=geometry,
            order=order,
            offsets=offsets,
            keys_w=sorted_keys,
            values=sorted_values,
            counts=counts.to(dtype),
            exact_read=exact_read,
            centroids=centroids,
            outlier_distance=outlier_distance,
            **stats,
        )

    @torch.no_grad()
    def extend(self, keys_w: torch.Tensor, values: torch.Tensor, **build_options) -> KeyClusters:
        """The representation of these keys followed by `keys_w` `(m, d_w)` and `values`
        `(m, dv)`: equal to `build` over all of them, given the `build_options` this
        representation was built with (the rank is its own). The new keys are assigned to the
        trained centroids and only the clusters they join are recomputed; when the trained
        prefix moves (`growth.retrains`), everything is built again with those options."""
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
        labels = self._assign(keys_w)
        order, offsets, sorted_keys, sorted_values = self._inserted(labels, keys_w, values)
        touched = labels.unique()
        stats = self._statistics_of(touched, offsets, sorted_keys, sorted_values)
        for name, part in stats.items():
            whole = getattr(self, name).clone()
            whole[touched] = part
            stats[name] = whole
        return type(self)(
            geometry=self.geometry,
            order=order,
            offsets=offsets,
            keys_w=sorted_keys,
            values=sorted_values,
            counts=offsets.diff().to(self.counts.dtype),
            exact_read=self.exact_read,
            centroids=self.centroids,
            outlier_distance=self.outlier_distance,
            **stats,
        )

    def _assign(self, keys_w: torch.Tensor) -> torch.Tensor:
        """The cluster of each new key: its nearest centroid, or the outlier cluster (the last)
        when it lies at least `outlier_distance` from it."""
        labels, distance = _nearest(_points(self.geometry.lift(keys_w, "key")), self.centroids)
        if self.n_clusters > self.centroids.shape[0]:
            labels = labels.masked_fill(distance >= self.outlier_distance, self.n_clusters - 1)
        return labels

    def _inserted(self, labels: torch.Tensor, keys_w: torch.Tensor, values: torch.Tensor):
        """`(order, offsets, keys_w, values)` sorted by cluster with the new keys at the end of
        their clusters (position order within a cluster, as `build` sorts): the old arrays cut
        after each cluster that gains keys, those keys in between (slices copied, no gather over
        all keys)."""
        touched, gained = labels.unique(return_counts=True)
        cuts = self.offsets[touched + 1].tolist()
        joining = labels.argsort(stable=True).split(gained.tolist())
        new_ids = torch.arange(self.n_keys, self.n_keys + len(labels), device=self.order.device)
        order = _spliced(self.order, new_ids, cuts, joining)
        sorted_keys = _spliced(self.keys_w, keys_w, cuts, joining)
        sorted_values = _spliced(self.values, values, cuts, joining)
        counts = self.offsets.diff().index_add(0, touched, gained)
        offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
        return order, offsets, sorted_keys, sorted_values

    def _statistics_of(self, clusters, offsets, sorted_keys, sorted_values) -> dict:
        """`_cluster_statistics` of some clusters only (their rows, in order)."""
        members = torch.cat(
            [torch.arange(offsets[c], offsets[c + 1], device=offsets.device) for c in clusters]
        )
        counts = offsets.diff()[clusters]
        return _cluster_statistics(
            key_features(self.geometry.lift(sorted_keys[members], "key")),
            sorted_values[members],
            torch.cat([counts.new_zeros(1), counts.cumsum(0)]),
            self.geometry.lift(sorted_keys[:1], "key"),
            self.rank,
        )

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


def kmeans(
    points: torch.Tensor, n_clusters: int, iterations: int, seed: int, device: str | None
) -> torch.Tensor:
    """FAISS k-means: the centroids `(n_clusters, P)` (float32, on the CPU)."""
    x = np.ascontiguousarray(points.detach().to("cpu", torch.float32).numpy())
    if n_clusters == 1:
        return torch.from_numpy(x.mean(0, keepdims=True))
    clustering = faiss.Kmeans(
        x.shape[1],
        n_clusters,
        niter=iterations,
        seed=seed,
        max_points_per_centroid=64,
        min_points_per_centroid=1,
        gpu=faiss_device(device) == "cuda",
    )
    clustering.train(x)
    return torch.from_numpy(clustering.centroids.copy())


def _spliced(
    old: torch.Tensor, new: torch.Tensor, cuts: list[int], joining: list[torch.Tensor]
) -> torch.Tensor:
    """`old` cut at each of `cuts`, with the rows `new[joining[i]]` put in after cut i."""
    parts, previous = [], 0
    for cut, rows in zip(cuts, joining, strict=True):
        parts += [old[previous:cut], new[rows]]
        previous = cut
    return torch.cat([*parts, old[previous:]])


def _points(lifts: list[Lift]) -> torch.Tensor:
    """The points k-means clusters: every lift's vectors, concatenated."""
    return torch.cat([lift.vectors for lift in lifts], dim=-1)


def _refined(points: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """One Lloyd step over all `points`: each centroid moved to the mean of the points nearest
    to it (kept where none is). k-means trains on a sample of 64 points per centroid; after
    this step the centroids are (close to) their clusters' means over every trained key, which
    the outlier distance is measured from."""
    labels, _ = _nearest(points, centroids)
    counts = torch.bincount(labels, minlength=centroids.shape[0]).unsqueeze(-1)
    sums = torch.zeros_like(centroids).index_add_(0, labels, points)
    return torch.where(counts > 0, sums / counts.clamp_min(1).to(points.dtype), centroids)


def _nearest(points: torch.Tensor, centroids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each point's nearest centroid `(n,)` (FAISS's exact search, in float32) and its Euclidean
    distance to it `(n,)` in the points' dtype."""
    search = faiss.IndexFlatL2(centroids.shape[-1])
    search.add(np.ascontiguousarray(centroids.detach().to("cpu", torch.float32).numpy()))
    _, found = search.search(np.ascontiguousarray(points.detach().to("cpu", torch.float32)), 1)
    labels = torch.from_numpy(found[:, 0]).long().to(points.device)
    return labels, (points - centroids[labels]).norm(dim=-1)


def _cluster_statistics(
    features: torch.Tensor,
    values: torch.Tensor,
    offsets: torch.Tensor,
    lifts: list[Lift],
    rank: int,
) -> dict[str, torch.Tensor]:
    """Per-cluster moments of sorted features `(n, D)` and values `(n, dv)`."""
    n_clusters, dim, value_dim = len(offsets) - 1, features.shape[-1], values.shape[-1]
    rank = min(rank, dim)
    blocks = _lift_blocks(lifts)
    like = features.new_zeros
    mean, residual = like(n_clusters, dim), like(n_clusters, dim)
    factor, radius = like(n_clusters, dim, rank), like(n_clusters, len(blocks))
    value_mean, value_cross = like(n_clusters, value_dim), like(n_clusters, dim, value_dim)
    bounds = offsets.tolist()
    for c in range(n_clusters):
        first, last = bounds[c], bounds[c + 1]
        if first == last:
            continue
        b, v = features[first:last].double(), values[first:last].double()
        mu, m = b.mean(0), v.mean(0)
        centred, centred_v = b - mu, v - m
        covariance = centred.T @ centred / len(b)
        eigenvalues, eigenvectors = torch.linalg.eigh(covariance)  # ascending
        top = eigenvectors[:, dim - rank :]
        root = eigenvalues[dim - rank :].clamp_min(0).sqrt()
        left_out = covariance.diagonal() - (top * root).square().sum(-1)
        mean[c], value_mean[c] = mu, m
        factor[c] = top * root
        residual[c] = left_out.clamp_min(0)
        value_cross[c] = centred.T @ centred_v / len(b)
        radius[c] = torch.stack([centred[:, s].norm(dim=-1).max() for s in blocks])
    return {
        "mean": mean,
        "factor": factor,
        "residual": residual,
        "radius": radius,
        "value_mean": value_mean,
        "value_cross": value_cross,
    }


def _lift_blocks(lifts: list[Lift]) -> list[slice]:
    """Each lift's block of the feature vector."""
    slices, start = [], 0
    for lift in lifts:
        width = lift.vectors.shape[-1] + (1 if lift.metric == "l2" else 0)
        slices.append(slice(start, start + width))
        start += width
    return slices


def default_clusters(n_keys: int) -> int:
    """The default number of clusters for `n_keys` keys."""
    return max(1, math.ceil(n_keys / DEFAULT_KEYS_PER_CLUSTER))
