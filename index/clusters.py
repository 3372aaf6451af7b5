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
  cluster, when the budget holds them (`tail.select_clusters`). `build` puts the `outliers`
  fraction of keys farthest from their k-means centre (0.1 % by default) into one such
  cluster, the last: a few far keys make a cluster's logits heavy-tailed where the Gaussian
  estimate assumes a light tail. On the `text` heads of `benchmarks/tail.py` (dot product,
  1 % of keys read, the same k-means clusters with and without; ad-hoc script) this lowered
  the worst heads' p99 error (head 8: 0.160 -> 0.136, head 9: 0.123 -> 0.107) and left the
  others within noise; keys far from their centre in absolute distance did better than in
  distance relative to their cluster's spread, or than the keys of largest norm.

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

    # Of `to_bytes`; 1 kept a rank-r value factor instead of value_cross, 2 had no exact_read.
    FORMAT = 3

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
        n_clusters = n_clusters or default_clusters(n)
        if not 1 <= n_clusters <= n:
            raise ValueError(f"expected 1 <= n_clusters <= {n}, got {n_clusters}")
        if rank < 0:
            raise ValueError(f"expected rank >= 0, got {rank}")
        if not 0 <= outliers < 1:
            raise ValueError(f"expected outliers in [0, 1) (a fraction of keys), got {outliers}")
        # float64 stays float64 (the exactness tests); half precisions compute in float32.
        dtype = torch.float64 if keys_w.dtype == torch.float64 else torch.float32
        keys_w, values = keys_w.to(dtype), values.to(dtype)
        lifts = geometry.lift(keys_w, "key")
        points = torch.cat([lift.vectors for lift in lifts], dim=-1)
        labels = kmeans(points, n_clusters, iterations, seed, device)
        labels = labels.to(keys_w.device)
        n_outliers = int(outliers * n)
        exact_read = torch.zeros(n_clusters, dtype=torch.bool, device=keys_w.device)
        if n_outliers > 0:
            labels = _outliers_apart(points, labels, n_clusters, n_outliers)
            exact_read = torch.cat([exact_read, exact_read.new_ones(1)])
            n_clusters += 1
        order = labels.argsort(stable=True)
        counts = torch.bincount(labels, minlength=n_clusters)
        offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
        features = key_features(lifts)[order]
        sorted_values = values[order]
        stats = _cluster_statistics(features, sorted_values, offsets, lifts, rank)
        return cls(
            geometry=geometry,
            order=order,
            offsets=offsets,
            keys_w=keys_w[order],
            values=sorted_values,
            counts=counts.to(keys_w.dtype),
            exact_read=exact_read,
            **stats,
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
    """FAISS k-means: each point's cluster `(n,)`."""
    x = np.ascontiguousarray(points.detach().to("cpu", torch.float32).numpy())
    if n_clusters == 1:
        return torch.zeros(len(x), dtype=torch.long)
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
    _, labels = clustering.index.search(x, 1)
    return torch.from_numpy(labels[:, 0]).long()


def _outliers_apart(
    points: torch.Tensor, labels: torch.Tensor, n_clusters: int, n_outliers: int
) -> torch.Tensor:
    """Labels with the `n_outliers` points farthest from their cluster's mean moved to a new
    cluster, `n_clusters`."""
    counts = torch.bincount(labels, minlength=n_clusters).clamp_min(1)
    sums = points.new_zeros(n_clusters, points.shape[-1]).index_add_(0, labels, points)
    distances = (points - (sums / counts.unsqueeze(-1).to(points.dtype))[labels]).norm(dim=-1)
    labels = labels.clone()
    labels[distances.topk(n_outliers).indices] = n_clusters
    return labels


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
