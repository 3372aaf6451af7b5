"""Indexes that follow appends (docs/indexes.md, "Appends"): an index built over a context's
first keys and extended with the rest, in any number of steps and across a retraining, equals
the index built over all of them at once."""

from __future__ import annotations

from dataclasses import fields
from itertools import pairwise

import pytest
import torch

from rewa.attention import make_geometry
from rewa.index import KeyClusters, build_index
from rewa.index.clusters import key_features
from rewa.index.growth import GROWTH, appended, retrains, trained_prefix
from rewa.index.tail import tail_attention


def test_the_trained_prefix_doubles():
    assert [trained_prefix(n) for n in (1, 100, 4096)] == [1, 100, 4096]
    assert [trained_prefix(n) for n in (4097, 8191, 8192, 12000, 131071, 131073)] == [
        4096, 4096, 8192, 8192, 65536, 131072,
    ]  # fmt: skip
    assert not retrains(5000, 8191) and retrains(8191, 8192) and retrains(100, 101)


def _keys(n, d=16, seed=0):
    generator = torch.Generator().manual_seed(seed)
    centres = torch.randn(32, d, generator=generator) * 2
    k = centres[torch.randint(32, (n,), generator=generator)] + torch.randn(
        n, d, generator=generator
    )
    return k, torch.randn(n, d, generator=generator)


# Cut points: below the training base, past it (no retraining), across a doubling, and one by one.
STEPS = [3000, 4096, 4100, 4101, 6000, 8191, 8192, 8193, 9000]


def test_a_grown_buffer_keeps_room_for_the_next_appends():
    """A buffer that takes a long prompt in one append has room to spare after it, so the next
    appends copy nothing; without `spare`, it is just large enough. What it holds is kept."""
    prompt, token = torch.randn(2, 1000, 3), torch.randn(2, 1, 3)
    for spare, capacity in ((True, int(1000 * GROWTH)), (False, 1000)):
        buffer = appended(torch.empty(2, 16, 3), 0, prompt, spare=spare)
        assert buffer.shape[1] == capacity and torch.equal(buffer[:, :1000], prompt)
        after = appended(buffer, 1000, token, spare=spare)
        assert (after.data_ptr() == buffer.data_ptr()) == spare
        assert torch.equal(after[:, :1001], torch.cat([prompt, token], 1))
    # Appends one at a time grow the buffer to GROWTH times what it holds each time it fills.
    buffer = torch.empty(1, 8, 1)
    for used in range(8, 40):
        before = buffer.shape[1]
        buffer = appended(buffer, used, torch.full((1, 1, 1), float(used)))
        assert buffer.shape[1] == (before if used < before else int((used + 1) * GROWTH))
    assert torch.equal(buffer[0, 8:40, 0], torch.arange(8.0, 40.0))


@pytest.mark.parametrize("geometry", ["dot", "euclidean", "poincare"])
def test_extended_clusters_equal_clusters_built_at_once(geometry):
    g = make_geometry(geometry, 16).double()
    k, v = _keys(STEPS[-1])
    k, v = k.double() * 0.1, v.double()
    kw = g.witness(k)
    grown = KeyClusters.build(kw[: STEPS[0]], v[: STEPS[0]], g)
    for start, stop in pairwise(STEPS):
        grown = grown.extend(kw[start:stop], v[start:stop])
        whole = KeyClusters.build(kw[:stop], v[:stop], g)
        for field in fields(KeyClusters):
            if field.name == "geometry":
                continue
            mine, theirs = getattr(grown, field.name), getattr(whole, field.name)
            if mine.dtype.is_floating_point:
                # The same keys' moments summed in another order differ by float64 rounding,
                # which the covariance's eigenvectors (`factor`) magnify by the inverse of its
                # eigen-gaps.
                tolerance = 1e-7 if field.name == "factor" else 1e-9
                torch.testing.assert_close(mine, theirs, rtol=tolerance, atol=tolerance)
            else:
                assert torch.equal(mine, theirs), (stop, field.name)
    assert grown.n_keys == STEPS[-1] and grown.exact_read[-1]  # the outlier cluster
    # Pieces were cut as they filled: none holds more than the cap.
    assert 0 < grown.counts[~grown.exact_read].max() <= int(grown.max_keys)
    q = torch.randn(8, 16, dtype=torch.float64) * 0.1
    out, lse = tail_attention(q, grown, budget=0.05, tail=True)
    expected = tail_attention(q, KeyClusters.build(kw, v, g), budget=0.05, tail=True)
    torch.testing.assert_close((out, lse), expected)


@pytest.mark.parametrize("geometry", ["dot", "poincare"])
@pytest.mark.parametrize("n", [8192, 12000])
def test_every_key_lies_in_the_piece_its_group_cuts_send_it_to(geometry, n):
    # The build lays out the trained keys in the pieces their cuts were drawn from, and walks
    # only the untrained ones down the cuts; an appended key is walked down them. Both must agree.
    g = make_geometry(geometry, 16).double()
    k, v = _keys(n)
    clusters = KeyClusters.build(g.witness(k.double() * 0.1), v.double(), g)
    assert clusters.n_clusters > clusters.centroids.shape[0] + 1  # groups were cut
    laid_out = torch.repeat_interleave(torch.arange(clusters.n_clusters), clusters.offsets.diff())
    lifts = g.lift(clusters.keys_w, "key")
    walked = clusters._trees().pieces_of(key_features(lifts), clusters._assign(lifts))
    assert torch.equal(walked, laid_out)


def test_a_retraining_extension_keeps_the_options_of_the_build():
    g = make_geometry("dot", 16)
    k, v = _keys(8300)
    options = {"outliers": 0.01, "rank": 2, "iterations": 5}
    grown = KeyClusters.build(g.witness(k[:8000]), v[:8000], g, **options)
    grown = grown.extend(g.witness(k[8000:8192]), v[8000:8192], outliers=0.01, iterations=5)
    whole = KeyClusters.build(g.witness(k[:8192]), v[:8192], g, **options)
    assert grown.rank == 2 and int(grown.counts[-1]) == int(whole.counts[-1]) == 81
    assert torch.equal(grown.order, whole.order)
    torch.testing.assert_close(grown.factor, whole.factor)


def test_appended_keys_far_from_every_centre_join_the_outlier_cluster():
    g = make_geometry("dot", 16)
    k, v = _keys(5000)
    clusters = KeyClusters.build(g.witness(k), v, g)
    far = torch.full((3, 16), 1e3)
    grown = clusters.extend(far, torch.zeros(3, 16))
    first, last = grown.offsets[-2:].tolist()
    assert {5000, 5001, 5002} <= set(grown.order[first:last].tolist())
    assert len(grown.counts) == len(clusters.counts)


@pytest.mark.parametrize("kind", ["ivf", "flat", "lsh"])
def test_an_extended_search_index_equals_one_built_at_once(kind):
    g = make_geometry("dot", 16)
    k, _ = _keys(STEPS[-1])
    grown = build_index(k[: STEPS[0]], g, kind)
    q = torch.randn(64, 16)
    for stop in STEPS[1:]:
        grown.extend(k[:stop])
        whole = build_index(k[:stop], g, kind)
        assert grown.ntotal == whole.ntotal == stop
        scores, ids = grown.search(q, 8)
        expected_scores, expected_ids = whole.search(q, 8)
        assert torch.equal(ids, expected_ids), stop
        torch.testing.assert_close(scores, expected_scores)
    if kind == "ivf":
        lists = grown.parts[0].lists()
        assert [ids.tolist() for ids in lists] == [ids.tolist() for ids in whole.parts[0].lists()]


def test_an_ivf_index_trains_on_the_prefix_only():
    g = make_geometry("dot", 16)
    k, _ = _keys(12000)
    index = build_index(k, g, "ivf")
    assert len(index.parts[0].lists()) == trained_prefix(12000) // 256 == 8192 // 256


def test_extending_with_fewer_keys_than_indexed_is_refused():
    g = make_geometry("dot", 16)
    k, _ = _keys(5000)
    index = build_index(k, g, "ivf")
    with pytest.raises(ValueError, match="at least the 5000 keys"):
        index.extend(k[:10])


def test_float32_clusters_extended_token_by_token_equal_a_build_bit_for_bit():
    """A cluster's moments do not depend on which other clusters they were computed with, so a
    float32 context grown by appends is the context built at once, exactly (the service's
    answers after a commit equal a fresh load's)."""
    g = make_geometry("dot", 16)
    k, v = _keys(6100)
    kw = g.witness(k)
    stops = [6000, 6001, *range(6012, 6101, 11)]
    grown = KeyClusters.build(kw[:6000], v[:6000], g)
    for start, stop in pairwise(stops):
        grown = grown.extend(kw[start:stop], v[start:stop])
    whole = KeyClusters.build(kw[: stops[-1]], v[: stops[-1]], g)
    for field in fields(KeyClusters):
        if field.name != "geometry":
            assert torch.equal(getattr(grown, field.name), getattr(whole, field.name)), field.name
