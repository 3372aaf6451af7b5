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


def faiss_kmeans(points, n_clusters, iterations, seed, metric="l2", spherical=False):
    """`faiss.Kmeans` with the settings rewa trains with: the reference `kmeans.kmeans` follows."""
    reference = faiss.Kmeans(
        points.shape[1], n_clusters, niter=iterations, seed=seed, max_points_per_centroid=64,
        min_points_per_centroid=1, spherical=spherical,
    )  # fmt: skip
    if metric == "ip":
        reference.index = faiss.IndexFlatIP(points.shape[1])
    reference.train(np.ascontiguousarray(points.numpy()))
    return torch.from_numpy(reference.centroids.copy())


@pytest.mark.parametrize("metric", ["l2", "ip"])
@pytest.mark.parametrize(
    "n, d, n_clusters",
    [(5000, 12, 300), (6400, 16, 64), (200, 4, 150), (64, 3, 64)],
    ids=["sampled", "sample-of-all", "few-points-per-centroid", "as-many-as-points"],
)
def test_kmeans_finds_the_centroids_of_faiss_kmeans(n, d, n_clusters, metric):
    """FAISS's draws (sample and starting centroids), Lloyd steps, float32 scaling and early
    stop: the same centroids as `faiss.Kmeans` with the same settings, to float rounding,
    whether the points are sampled (more than 64 per centroid) or not, over several seeds."""
    spherical = metric == "ip"
    for seed in (0, 1, 1234):
        points = torch.randn(n, d, generator=torch.Generator().manual_seed(seed))
        points = (
            points
            + 4
            * torch.randn(16, d, generator=torch.Generator().manual_seed(9))[torch.arange(n) % 16]
        )  # 16 blobs
        found = kmeans.kmeans(points, n_clusters, 10, seed, 64, metric, spherical)
        assert found.shape == (n_clusters, d) and found.dtype == torch.float32
        expected = faiss_kmeans(points, n_clusters, 10, seed, metric, spherical)
        torch.testing.assert_close(found, expected, rtol=0, atol=1e-6)


def test_kmeans_splits_clusters_left_empty_as_faiss_does():
    """Duplicated points leave most starting centroids without points: each one takes half of
    a cluster drawn as FAISS's `split_clusters` draws it (its Mersenne twister seeded 1234),
    the two halves 1/1024 apart. After one step the centroids are FAISS's exactly; after that
    the halves lie so close that float rounding decides some points, so later steps are not
    compared."""
    distinct = torch.randn(30, 8, generator=torch.Generator().manual_seed(4))
    points = distinct.repeat(100, 1)
    labels = kmeans.nearest(points, points[kmeans.faiss_permutation(len(points), 1)[:100]])
    assert torch.bincount(labels, minlength=100).eq(0).sum() > 50  # most start empty
    found = kmeans.kmeans(points, 100, 1, 0)
    torch.testing.assert_close(found, faiss_kmeans(points, 100, 1, 0), rtol=0, atol=1e-6)
    assert torch.unique(found, dim=0).shape[0] == 100  # every centroid distinct, none empty
    counts = torch.bincount(kmeans.nearest(points, found), minlength=100)
    assert (counts > 0).sum() >= 30  # every distinct point has a centroid of its own


def test_faiss_permutation_is_a_fisher_yates_shuffle_of_numpys_twister():
    """The draws k-means starts from (FAISS's `rand_perm`) are a Fisher-Yates shuffle driven by
    the 32-bit outputs of numpy's Mersenne twister seeded the same: the generator seeded as
    C++'s `std::mt19937`, on which `split_empty`'s draws rely too."""
    for n, seed in ((1, 0), (10, 3), (1000, 1234)):
        draws = np.random.RandomState(seed).randint(0, 2**32, size=max(n - 1, 0), dtype=np.uint32)
        expected = list(range(n))
        for i, draw in enumerate(draws.tolist()):
            j = i + draw % (n - i)
            expected[i], expected[j] = expected[j], expected[i]
        assert kmeans.faiss_permutation(n, seed).tolist() == expected


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


@pytest.mark.parametrize("dataset", ["clustered", "overlapping", "tree"])
def test_an_ivf_index_trained_in_pytorch_holds_the_lists_faiss_training_makes(dataset, monkeypatch):
    """The lists of an IVF index trained and filled in PyTorch are those FAISS's own training
    and assignment make (the same centroids, each key in the same list), for the dot product,
    Euclidean and Poincare (augmented) lifts of benchmarks/data.py."""
    from benchmarks.data import DATASETS

    def trained_by_faiss(self, vectors, n_trained):  # what `add` did before
        keys = self._keys(vectors)
        index = self._build(keys.shape[1], n_trained)
        index.train(keys[:n_trained])
        index.add(keys)
        self.index, self._lists, self._layouts = index, None, {}

    data = DATASETS[dataset](8192)
    torch_trained = build_index(data.k, data.geometry(), "ivf")
    monkeypatch.setattr(LiftIndex, "_add_trained_in_pytorch", trained_by_faiss)
    faiss_trained = build_index(data.k, data.geometry(), "ivf")
    for ours, theirs in zip(torch_trained.parts, faiss_trained.parts, strict=True):
        lists, expected_lists = (
            _list_of_each_key(*ours.list_layout()),
            _list_of_each_key(*theirs.list_layout()),
        )
        if dataset == "tree":
            # The Poincare lifts' k-means is ill-conditioned: FAISS's AVX-512 distances round
            # differently from PyTorch's and move a few keys across a boundary, which the
            # following iterations carry on (on an AVX2 CPU the lists were equal; 0.6 % of the
            # keys moved on an AVX-512 Xeon).
            assert (lists == expected_lists).float().mean() >= 0.99
        else:
            assert torch.equal(lists, expected_lists)


def _list_of_each_key(ids: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """The list of each key id `(n,)`, from a list layout (ids grouped by list, list sizes)."""
    lists = torch.repeat_interleave(torch.arange(len(sizes)), sizes)
    return torch.empty_like(lists).index_copy_(0, ids.long(), lists)


@pytest.mark.parametrize("dataset", ["clustered", "overlapping"])
def test_tail_clusters_are_those_of_faiss_kmeans(dataset, monkeypatch):
    """`KeyClusters.build` with its PyTorch k-means builds the clusters it built with FAISS's
    k-means (the same pieces, keys in the same order), and the same statistics."""
    from benchmarks.data import DATASETS
    from rewa.index import KeyClusters, clusters

    data = DATASETS[dataset](16384)
    g = data.geometry()
    ours = KeyClusters.build(g.witness(data.k), data.v, g)

    def by_faiss(points, n_clusters, iterations, seed):
        return faiss_kmeans(points.float(), n_clusters, iterations, seed)

    monkeypatch.setattr(clusters, "kmeans", by_faiss)
    theirs = KeyClusters.build(g.witness(data.k), data.v, g)
    assert torch.equal(ours.order, theirs.order)
    assert torch.equal(ours.offsets, theirs.offsets)
    torch.testing.assert_close(ours.centroids, theirs.centroids, rtol=0, atol=1e-6)
    torch.testing.assert_close(ours.mean, theirs.mean)


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
