"""k-means and assignment in PyTorch (index/kmeans.py), the GPU's path when FAISS has no GPU
support; here on the CPU, where they compute the same things."""

import numpy as np
import pytest
import torch

from rewa.index import build_index, kmeans
from rewa.index.faiss_index import IndexSettings, LiftIndex, faiss


def blobs(n_centres=8, per_centre=200, d=6, seed=0):
    generator = torch.Generator().manual_seed(seed)
    centres = torch.randn(n_centres, d, generator=generator) * 10
    labels = torch.arange(n_centres).repeat_interleave(per_centre)
    points = centres[labels] + 0.1 * torch.randn(len(labels), d, generator=generator)
    return points, centres, labels


def inertia(points, centroids):
    return torch.cdist(points.double(), centroids.double()).min(-1).values.square().sum().item()


def test_kmeans_fits_as_well_as_faiss_kmeans():
    """The same Lloyd iterations as FAISS's k-means from other random starts: over several
    seeds a fit as tight (the sum of squared distances to the nearest centroid) on mixtures of
    many components. One start may land 15 % above or below FAISS's; the total may not."""
    ours, theirs = 0.0, 0.0
    for seed in range(4):
        points, _, _ = blobs(n_centres=64, per_centre=100, d=16, seed=seed)
        noise = torch.randn(points.shape, generator=torch.Generator().manual_seed(seed))
        points = points + 3 * noise
        found = kmeans.kmeans(points, 64, iterations=10, seed=seed, max_points_per_centroid=64)
        assert found.shape == (64, 16) and found.dtype == torch.float32
        reference = faiss.Kmeans(16, 64, niter=10, seed=seed, max_points_per_centroid=64)
        reference.train(np.ascontiguousarray(points.numpy()))
        ours += inertia(points, found)
        theirs += inertia(points, torch.from_numpy(reference.centroids))
        start = points[torch.randperm(len(points), generator=torch.Generator().manual_seed(9))]
        assert inertia(points, found) < 0.8 * inertia(points, start[:64])
    assert ours <= 1.05 * theirs


def test_kmeans_keeps_every_centroid_in_use_and_is_seeded():
    points, _, _ = blobs(n_centres=3)
    first = kmeans.kmeans(points, 12, iterations=10, seed=7)
    again = kmeans.kmeans(points, 12, iterations=10, seed=7)
    assert torch.equal(first, again)
    assert torch.isfinite(first).all()
    with pytest.raises(ValueError, match="n_clusters"):
        kmeans.kmeans(points[:5], 6, iterations=1, seed=0)


@pytest.mark.parametrize("metric", ["l2", "ip"])
def test_nearest_is_the_brute_force_assignment(metric, monkeypatch):
    generator = torch.Generator().manual_seed(3)
    points = torch.randn(1000, 5, generator=generator)
    centroids = torch.randn(17, 5, generator=generator)
    monkeypatch.setattr(kmeans, "ASSIGN_ELEMENTS", 17 * 64)  # 16 blocks of 64 points
    monkeypatch.setattr(kmeans, "CPU_BLOCK_ELEMENTS", 17 * 64)  # the same on the CPU
    got = kmeans.nearest(points, centroids, metric)
    if metric == "l2":
        expected = torch.cdist(points.double(), centroids.double()).argmin(-1)
    else:
        expected = (points.double() @ centroids.double().T).argmax(-1)
    assert torch.equal(got, expected)
    with pytest.raises(ValueError, match="metric"):
        kmeans.nearest(points, centroids, "cosine")


def test_on_device_needs_cuda_points_and_a_cpu_faiss():
    assert not kmeans.on_device(torch.zeros(2, 2), "cpu")

    class CudaPoints:
        device = torch.device("cuda")

    assert kmeans.on_device(CudaPoints(), "cpu")
    assert not kmeans.on_device(CudaPoints(), "cuda")


@pytest.mark.parametrize("metric", ["l2", "ip"])
def test_an_ivf_index_trained_in_pytorch_is_a_faiss_index_of_its_lists(metric):
    """`LiftIndex.add` for a CPU FAISS IVF index (on the CPU, or for keys on a GPU that FAISS
    cannot use): FAISS holds the PyTorch centroids and each key in the list of its nearest
    one, `lists()` answers the same lists before and after they are read back from FAISS, and
    search finds each key itself."""
    points, _, _ = blobs(n_centres=16, per_centre=100, d=8)
    lift = LiftIndex(metric, IndexSettings(kind="ivf", nlist=16, nprobe=16))
    lift.add(points)
    on_device = lift.lists()
    assert sorted(torch.cat(on_device).tolist()) == list(range(len(points)))
    ids, sizes = lift.list_layout()  # made with the lists, not from them
    assert torch.equal(ids, torch.cat(on_device))
    assert sizes.tolist() == [len(listed) for listed in on_device]
    # Each key lies in the list of a nearest centroid (float64 distances; centroids that tie
    # within float32 rounding may take either), by FAISS's metric for this lift.
    ivf = faiss.extract_index_ivf(lift.index)
    centroids = torch.from_numpy(ivf.quantizer.reconstruct_n(0, ivf.nlist)).double()
    keys = torch.from_numpy(lift._keys(points)).double()
    if lift.augmented or metric == "l2":
        cost = torch.cdist(keys, centroids).square()
    else:
        cost = -(keys @ centroids.T)
    label = torch.empty(len(points), dtype=torch.long)
    for c, ids in enumerate(on_device):
        label[ids] = c
    chosen = cost.gather(1, label.unsqueeze(-1)).squeeze(-1)
    assert (chosen <= cost.min(-1).values + 1e-5 * cost.abs().max()).all()
    lift._lists = None  # read back from FAISS's inverted lists
    assert [ids.tolist() for ids in lift.lists()] == [ids.tolist() for ids in on_device]
    assert lift.ntotal == len(points)
    if metric == "l2":
        _, found = lift.search(points[:50], 1)
        assert torch.equal(found[:, 0], torch.arange(50))


def test_inner_product_cells_are_spherical_as_faiss_trains_them():
    """FAISS trains an inner-product IVF index with centroids of unit norm (a cell is a
    direction, not pulled towards the longest keys); the PyTorch training does the same."""
    points, _, _ = blobs(n_centres=16, per_centre=100, d=8)
    points = points * torch.linspace(0.5, 2.0, len(points)).unsqueeze(-1)  # spread norms
    lift = LiftIndex("ip", IndexSettings(kind="ivf", nlist=16, ip_as_l2=False))
    lift.add(points)
    ivf = faiss.extract_index_ivf(lift.index)
    assert ivf.cp.spherical
    norms = torch.from_numpy(ivf.quantizer.reconstruct_n(0, ivf.nlist)).norm(dim=-1)
    torch.testing.assert_close(norms, torch.ones(16))
    means = kmeans.kmeans(points, 16, iterations=5, seed=0, metric="ip")
    assert (means.norm(dim=-1) - 1).abs().max() > 0.5  # plain means without `spherical`


def test_retrieval_over_an_index_trained_in_pytorch_matches_faiss_training(monkeypatch):
    """Sparse attention through lists trained in PyTorch reads as many of the true neighbours
    as through lists trained by FAISS."""
    from benchmarks.data import clustered
    from rewa.index import exact_topk, retrieval_attention, topk_recall
    from rewa.index.ivf_blocks import probed_keys

    def trained_by_faiss(self, vectors, n_trained):  # what `add` did before
        keys = self._keys(vectors)
        index = self._build(keys.shape[1], n_trained)
        index.train(keys[:n_trained])
        index.add(keys)
        self.index, self._lists, self._layouts = index, None, {}

    data = clustered(8192)
    g = data.geometry()
    torch_trained = build_index(data.k, g, "ivf")
    monkeypatch.setattr(LiftIndex, "_add_trained_in_pytorch", trained_by_faiss)
    faiss_trained = build_index(data.k, g, "ivf")
    assert not torch.equal(
        *(index.parts[0].list_layout()[1] for index in (faiss_trained, torch_trained))
    )
    queries = data.q[:256]
    with torch.no_grad():
        qw = g.witness(queries)
        exact = exact_topk(qw, g.witness(data.k), g, 16)
        recalls = [
            topk_recall(probed_keys(index, qw), exact).mean().item()
            for index in (faiss_trained, torch_trained)
        ]
        out = retrieval_attention(queries, data.k, data.v, g, index=torch_trained)[0]
    assert recalls[1] >= recalls[0] - 0.02 and recalls[1] > 0.9
    assert torch.isfinite(out).all()


def test_tail_clusters_trained_in_pytorch_estimate_as_well(monkeypatch):
    """KeyClusters built with PyTorch's k-means (forced here on the CPU) give
    tail attention as accurate as with FAISS's, on overlapping clusters where the estimate
    carries a visible error."""
    from benchmarks.data import overlapping
    from rewa.attention import dense_attention
    from rewa.index import KeyClusters, clusters, output_error, tail_attention

    data = overlapping(16384)
    g = data.geometry()
    queries = data.q[:256]
    calls = []
    in_pytorch = clusters.torch_kmeans
    monkeypatch.setattr(
        clusters, "torch_kmeans", lambda *a, **o: calls.append(1) or in_pytorch(*a, **o)
    )
    with torch.no_grad():
        exact = dense_attention(queries, data.k, data.v, g)[0]
        errors = []
        for forced in (False, True):
            monkeypatch.setattr(clusters, "on_device", lambda points, device, forced=forced: forced)
            built = KeyClusters.build(g.witness(data.k), data.v, g)
            out = tail_attention(g.witness(queries), built, budget=0.02)[0]
            errors.append(output_error(out, exact))
    assert len(calls) == 1  # PyTorch's k-means ran for the second build only
    assert errors[0].median() > 1e-3  # an error to compare
    assert errors[1].median() <= 1.3 * errors[0].median()
    assert errors[1].quantile(0.99) <= 1.3 * errors[0].quantile(0.99)


def test_tail_nearest_centres_are_those_of_faiss_flat_search():
    """The tail build's nearest centres (`clusters._nearest`, PyTorch's products) are the ones
    FAISS's exact flat search finds, so a build's clusters did not change when it stopped
    using FAISS for them; the distances are to those centres, in the points' dtype."""
    from rewa.index import clusters

    generator = torch.Generator().manual_seed(5)
    for dtype in (torch.float32, torch.float64):
        points = torch.randn(5000, 12, generator=generator, dtype=dtype)
        centres = torch.randn(300, 12, generator=generator, dtype=dtype)
        labels, distance = clusters._nearest(points, centres)
        flat = faiss.IndexFlatL2(12)
        flat.add(centres.float().numpy())
        _, found = flat.search(points.float().numpy(), 1)
        assert torch.equal(labels, torch.from_numpy(found[:, 0]).long())
        assert distance.dtype == dtype
        assert torch.allclose(distance, (points - centres[labels]).norm(dim=-1))


@pytest.mark.parametrize("n", [0, 1, 100])
def test_distances_to_centres_in_blocks_equal_one_block(n, monkeypatch):
    """`clusters._distances` in blocks of `DISTANCE_ROWS` points gives each point's distance to
    its labelled centre exactly as one block of every point does (float32 and float64)."""
    from rewa.index import clusters

    monkeypatch.setattr(clusters, "DISTANCE_ROWS", 7)
    for dtype in (torch.float32, torch.float64):
        points, centres = torch.randn(n, 5, dtype=dtype), torch.randn(9, 5, dtype=dtype)
        labels = torch.randint(9, (n,))
        blocked = clusters._distances(points, centres, labels)
        assert blocked.shape == (n,) and blocked.dtype == dtype
        assert torch.equal(blocked, (points - centres[labels]).norm(dim=-1))
