"""k-means and nearest-centroid assignment in PyTorch, on the points' device: what the IVF lists
(`faiss_index.LiftIndex`) and the tail clusters (`clusters.KeyClusters`) are trained and filled
with on the CPU and on a GPU (docs/indexes.md, "IVF lists on a GPU", "IVF lists trained in
PyTorch").

`kmeans` is FAISS's `Clustering` step by step, with FAISS's random draws, so it finds the
centroids `faiss.Kmeans` finds with the same settings (up to float rounding where two centroids
tie for a point): a sample of `max_points_per_centroid` points per centroid drawn by FAISS's
`rand_perm(seed)`, the starting centroids by `rand_perm(seed + 1)` over the sample, then
`iterations` Lloyd steps (exact assignment by a matrix product per block of points, the sums
scaled by `1 / count` in float32, each centroid left without points given half of a cluster
drawn as FAISS's `split_clusters` draws it), stopping early when no point changes centroid (as
FAISS stops when its objective stops changing), the centroids scaled to unit norm where
`spherical` (as FAISS trains an inner-product IVF index).

On the CPU each block's scores are written into one reused buffer of `CPU_BLOCK_ELEMENTS` (it
stays in the cache) and numpy finds each row's best: `torch.argmax` over rows of 512 scores
ran about 9x slower than numpy's (docs/benchmark-notes.md, "Measurements behind code
choices")."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from .faiss_lib import faiss

# Points assigned per matrix product: (points x centroids) float32 scores at most this many.
ASSIGN_ELEMENTS = 1 << 27
# On the CPU: scores per block, a buffer of 4 MiB in float32.
CPU_BLOCK_ELEMENTS = 1 << 20


@torch.no_grad()
def kmeans(
    points: torch.Tensor,
    n_clusters: int,
    iterations: int,
    seed: int,
    max_points_per_centroid: int = 64,
    metric: str = "l2",
    spherical: bool = False,
) -> torch.Tensor:
    """The centroids `(n_clusters, D)` of `points (n, D)` (float32, on the points' device);
    `metric` "l2" or "ip" (a point joins the centroid of largest inner product, as FAISS's
    inner-product quantizer assigns); `spherical`: the centroids scaled to unit norm. FAISS's
    `Clustering` step by step, with its random draws (module docstring)."""
    if not 1 <= n_clusters <= points.shape[0]:
        raise ValueError(f"expected 1 <= n_clusters <= {points.shape[0]}, got {n_clusters}")
    x = points.detach().to(torch.float32)
    if x.shape[0] == n_clusters:
        return x.clone()  # FAISS's corner case: the points themselves
    sample = max_points_per_centroid * n_clusters
    if x.shape[0] > sample:
        x = x[faiss_permutation(x.shape[0], seed)[:sample].to(x.device)]
    centroids = x[faiss_permutation(x.shape[0], seed + 1)[:n_clusters].to(x.device)]
    centroids = _unit_norm(centroids) if spherical else centroids
    labels = None
    for _ in range(iterations):
        assigned = nearest(x, centroids, metric)
        if labels is not None and torch.equal(assigned, labels):
            break  # FAISS stops when its objective stops changing: the same centroids again
        labels = assigned
        counts = torch.bincount(labels, minlength=n_clusters)
        centroids = split_empty(cluster_sums(x, labels, n_clusters) * _inverse(counts), counts)
        centroids = _unit_norm(centroids) if spherical else centroids
    return centroids


def faiss_permutation(n: int, seed: int) -> torch.Tensor:
    """FAISS's `rand_perm(n, seed)` `(n,)`: its Fisher-Yates shuffle from a Mersenne twister,
    which draws its k-means sample (`seed`) and starting centroids (`seed + 1`)."""
    perm = np.empty(n, dtype=np.int32)
    faiss.rand_perm(faiss.swig_ptr(perm), n, seed)
    return torch.from_numpy(perm).long()


def cluster_means(
    points: torch.Tensor, labels: torch.Tensor, fallback: torch.Tensor
) -> torch.Tensor:
    """The mean of the points of each label `(C, D)` (a Lloyd step's update), `fallback[c]` for
    a label no point has."""
    counts = torch.bincount(labels, minlength=fallback.shape[0]).unsqueeze(-1)
    sums = cluster_sums(points, labels, fallback.shape[0])
    return torch.where(counts > 0, sums / counts.clamp_min(1).to(points.dtype), fallback)


def cluster_sums(points: torch.Tensor, labels: torch.Tensor, n_clusters: int) -> torch.Tensor:
    """The sum of the points of each label `(n_clusters, D)`, added in the points' order."""
    sums = points.new_zeros(n_clusters, points.shape[1])
    return sums.index_add_(0, labels, points)


def _inverse(counts: torch.Tensor) -> torch.Tensor:
    """`1 / count` per cluster `(C, 1)` in float32 (0 where none), as FAISS scales its sums."""
    return torch.where(counts > 0, 1 / counts.clamp_min(1).to(torch.float32), 0.0).unsqueeze(-1)


def _unit_norm(centroids: torch.Tensor) -> torch.Tensor:
    return centroids / centroids.norm(dim=-1, keepdim=True).clamp_min(1e-20)


# FAISS's relative perturbation of the two halves of a split cluster.
SPLIT_EPS = 1 / 1024
# How many of FAISS's draws are made at a time while looking for the cluster to split.
SPLIT_DRAWS = 4096


def split_empty(centroids: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """FAISS's `split_clusters`: each centroid without points, in order, takes the place of one
    half of a cluster drawn with probability (its count - 1) / (n - C), walking the clusters
    round from the first with one draw each of a Mersenne twister seeded 1234 (after 10 C
    draws without one, the largest cluster); the two halves are the drawn centroid scaled by
    1 +- 1/1024 alternately per coordinate, and share its count. Unchanged when every
    centroid has points."""
    empty = (counts == 0).nonzero().flatten().tolist()
    if not empty:
        return centroids
    k = counts.shape[0]
    moved = centroids.cpu().numpy().copy()
    hassign = counts.cpu().numpy().astype(np.float32)
    n_minus_k = np.float64(np.float32(int(counts.sum()) - k))
    draws = _twister_floats(1234)
    up = np.where(np.arange(moved.shape[1]) % 2 == 0, 1 + SPLIT_EPS, 1 - SPLIT_EPS)
    up = up.astype(np.float32)
    down = (2 - up).astype(np.float32)
    for ci in empty:
        chance = ((hassign.astype(np.float64) - 1.0) / n_minus_k).astype(np.float32)
        cj = next((j % k for j in range(10 * k) if next(draws) < chance[j % k]), None)
        cj = int(hassign.argmax()) if cj is None else cj
        moved[ci] = moved[cj] * up
        moved[cj] = moved[cj] * down
        hassign[ci] = hassign[cj] / np.float32(2)
        hassign[cj] -= hassign[ci]
    return torch.from_numpy(moved).to(centroids.device)


def _twister_floats(seed: int) -> Iterator[np.float32]:
    """FAISS's `RandomGenerator(seed).rand_float()` in sequence: the 32-bit outputs of a
    Mersenne twister (numpy's, seeded as C++'s `std::mt19937`) over 2^32 - 1, in float32,
    drawn `SPLIT_DRAWS` at a time."""
    twister = np.random.RandomState(seed)
    while True:
        raw = twister.randint(0, 2**32, size=SPLIT_DRAWS, dtype=np.uint32)
        yield from raw.astype(np.float32) / np.float32(4294967295.0)


@torch.no_grad()
def nearest(points: torch.Tensor, centroids: torch.Tensor, metric: str = "l2") -> torch.Tensor:
    """Each point's centroid `(n,)`: the nearest in L2, or of largest inner product ("ip"),
    from float32 matrix products in blocks of `ASSIGN_ELEMENTS` scores (`CPU_BLOCK_ELEMENTS`
    on the CPU, module docstring)."""
    if metric not in ("l2", "ip"):
        raise ValueError(f"expected metric 'l2' or 'ip', got {metric!r}")
    x = points.detach().to(torch.float32)
    c = centroids.detach().to(torch.float32)
    # argmin |x - c|^2 = argmax 2 x.c - |c|^2
    bias = None if metric == "ip" else -c.square().sum(-1)
    if x.device.type == "cpu":
        return _nearest_on_cpu(x, c, bias)
    step = max(1, ASSIGN_ELEMENTS // max(1, c.shape[0]))
    labels = []
    for begin in range(0, x.shape[0], step):
        block = x[begin : begin + step]
        scores = block @ c.T if bias is None else torch.addmm(bias, block, c.T, alpha=2)
        labels.append(scores.argmax(-1))
    return torch.cat(labels) if labels else torch.zeros(0, dtype=torch.long, device=x.device)


def _nearest_on_cpu(x: torch.Tensor, c: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`nearest` on the CPU: each block's scores in one reused buffer, each row's best by
    numpy (the first of equal scores, as `torch.argmax`)."""
    labels = np.empty(x.shape[0], dtype=np.int64)
    rows = max(1, CPU_BLOCK_ELEMENTS // max(1, c.shape[0]))
    scores = x.new_empty(min(rows, x.shape[0]), c.shape[0])
    c_t = c.T.contiguous()
    for begin in range(0, x.shape[0], rows):
        block = x[begin : begin + rows]
        out = scores[: block.shape[0]]
        if bias is None:
            torch.mm(block, c_t, out=out)
        else:
            torch.addmm(bias, block, c_t, alpha=2, out=out)
        out.numpy().argmax(-1, out=labels[begin : begin + block.shape[0]])
    return torch.from_numpy(labels)
