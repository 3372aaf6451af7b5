"""k-means and nearest-centroid assignment in PyTorch, on the points' device: what the IVF lists
(`faiss_index.LiftIndex`) are trained and filled with on the CPU and on a GPU, what the tail
clusters (`clusters.KeyClusters`) are trained with on a GPU when the FAISS build has no GPU
support (`on_device`), instead of copying the points to the CPU for FAISS, and how the tail's
keys find their nearest centres everywhere (docs/indexes.md, "IVF lists on a GPU", "IVF lists
trained in PyTorch").

The algorithm is FAISS's `Clustering` with the settings rewa gives it: a seeded sample of at
most `max_points_per_centroid` points per centroid, centroids started at distinct sample points,
`iterations` Lloyd steps of exact assignment (a matrix product per block of points) and mean
update, the means scaled to unit norm where `spherical` (as FAISS trains an inner-product IVF
index). A centroid left without points is moved to a sample point drawn with the same seed
(FAISS splits the largest cluster instead; both keep every centroid in use).

On the CPU each block's scores are written into one reused buffer of `CPU_BLOCK_ELEMENTS` (it
stays in the cache) and numpy finds each row's best: `torch.argmax` over rows of 512 scores
ran about 9x slower than numpy's (docs/benchmark-notes.md, "Measurements behind code
choices")."""

from __future__ import annotations

import numpy as np
import torch

# Points assigned per matrix product: (points x centroids) float32 scores at most this many.
ASSIGN_ELEMENTS = 1 << 27
# On the CPU: scores per block, a buffer of 4 MiB in float32.
CPU_BLOCK_ELEMENTS = 1 << 20


def on_device(points: torch.Tensor, faiss_device: str) -> bool:
    """Whether k-means and assignment of `points` run here in PyTorch: the points are on a
    CUDA device and FAISS (`faiss_device`, "cpu" or "cuda") cannot use it."""
    return points.device.type == "cuda" and faiss_device == "cpu"


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
    inner-product quantizer assigns); `spherical`: each update's means scaled to unit norm."""
    if not 1 <= n_clusters <= points.shape[0]:
        raise ValueError(f"expected 1 <= n_clusters <= {points.shape[0]}, got {n_clusters}")
    x = points.detach().to(torch.float32)
    generator = torch.Generator(device=x.device).manual_seed(seed)
    sample = max_points_per_centroid * n_clusters
    if x.shape[0] > sample:
        x = x[torch.randperm(x.shape[0], generator=generator, device=x.device)[:sample]]
    start = torch.randperm(x.shape[0], generator=generator, device=x.device)[:n_clusters]
    centroids = x[start].clone()
    for _ in range(iterations):
        spare = x[torch.randint(x.shape[0], (n_clusters,), generator=generator, device=x.device)]
        centroids = cluster_means(x, nearest(x, centroids, metric), spare)
        if spherical:
            centroids = centroids / centroids.norm(dim=-1, keepdim=True).clamp_min(1e-20)
    return centroids


def cluster_means(
    points: torch.Tensor, labels: torch.Tensor, fallback: torch.Tensor
) -> torch.Tensor:
    """The mean of the points of each label `(C, D)` (a Lloyd step's update), `fallback[c]` for
    a label no point has."""
    counts = torch.bincount(labels, minlength=fallback.shape[0]).unsqueeze(-1)
    sums = torch.zeros_like(fallback).index_add_(0, labels, points)
    return torch.where(counts > 0, sums / counts.clamp_min(1).to(points.dtype), fallback)


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
