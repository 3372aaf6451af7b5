"""Logits without autograd from a geometry's product form (`Geometry.score_from_terms`,
`TileLogits`): the same logits as `Geometry.score` under autograd, whole or tile by tile, near
pairs included; none where autograd records, in half precision or without a product form."""

import pytest
import torch

from rewa.attention import make_geometry
from rewa.attention.geometry import TileLogits
from tests.support import FUSED

DIM = 12


def _witnesses(geometry, n_queries, n_keys, dtype, batch=(), seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = 0.4 * torch.randn(*batch, n_queries, DIM, generator=generator, dtype=dtype)
    k = 0.4 * torch.randn(*batch, n_keys, DIM, generator=generator, dtype=dtype)
    return geometry.witness(q), geometry.witness(k)


def _recorded_score(geometry, qw, kw):
    """`score` through its autograd path (queries that require a gradient)."""
    with torch.enable_grad():
        return geometry.score(qw.detach().clone().requires_grad_(), kw).detach()


@pytest.mark.parametrize(("name", "options"), FUSED, ids=[f"{n}{o}" for n, o in FUSED])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("batch", [(), (3,)], ids=["no-head-axis", "head-axis"])
def test_logits_from_terms_equal_the_recorded_score(name, options, dtype, batch):
    geometry = make_geometry(name, DIM, heads=3, **options).to(dtype)
    qw, kw = _witnesses(geometry, 37, 53, dtype, batch)
    expected = _recorded_score(geometry, qw, kw)
    with torch.no_grad():
        from_terms = geometry.score_from_terms(qw, kw)
        score = geometry.score(qw, kw)
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {}
    torch.testing.assert_close(score, expected, **tolerance)
    if from_terms is not None:
        torch.testing.assert_close(from_terms, expected, **tolerance)
    if batch:  # every geometry of FUSED has a product form here, and its logits are that form's
        assert from_terms is not None


@pytest.mark.parametrize(("name", "options"), FUSED, ids=[f"{n}{o}" for n, o in FUSED])
def test_tiles_equal_the_score_of_their_queries_and_keys(name, options):
    geometry = make_geometry(name, DIM, heads=3, **options).double()
    qw, kw = _witnesses(geometry, 40, 90, torch.float64, (3,))
    with torch.no_grad():
        tiles = TileLogits.of(geometry, qw, kw)
        assert tiles is not None
        for rows, cols in [
            (slice(0, 7), slice(0, 90)),
            (slice(7, 8), slice(30, 61)),
            (slice(8, 40), slice(61, 90)),
        ]:
            expected = _recorded_score(geometry, qw[:, rows], kw[:, cols])
            torch.testing.assert_close(tiles.tile(rows, cols), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["euclidean", "sphere", "poincare", "product"])
def test_a_tile_recomputes_its_near_pairs(name):
    # Queries that are keys (tail attention's probes are): a Gram expansion alone leaves their
    # float32 self-distances at rounding noise; recomputed, each is 0 and the tile equals
    # `score`, which recomputes them too.
    geometry = make_geometry(name, DIM, power=1)
    _, kw = _witnesses(geometry, 1, 64, torch.float32, seed=3)
    kw = kw * 2.2 if name == "poincare" else kw  # witnesses near the boundary
    kw = geometry.witness(kw) if name == "poincare" else kw
    qw = kw[10:30]
    with torch.no_grad():
        tiles = TileLogits.of(geometry, qw, kw)
        tile = tiles.tile(slice(2, 12), slice(0, 64))
        gram = [term.queries[2:12] @ term.keys.T for term in geometry.score_terms(qw, kw)]
    expected = _recorded_score(geometry, qw[2:12], kw)
    torch.testing.assert_close(tile, expected, rtol=1e-6, atol=1e-6)
    self_pairs = (torch.arange(10), torch.arange(12, 22))
    assert bool((tile[self_pairs].abs() < 1e-12).all())
    if name != "product":  # one term, a squared distance: unrefined, its self-pairs are noise
        assert bool((gram[0][self_pairs].abs() > 1e-10).any())


def test_no_tiles_where_autograd_records_in_half_precision_or_without_a_product_form():
    geometry = make_geometry("poincare", DIM)
    qw, kw = _witnesses(geometry, 5, 9, torch.float32)
    with torch.enable_grad():
        assert TileLogits.of(geometry, qw, kw) is None  # the temperature requires a gradient
        geometry.requires_grad_(False)
        assert TileLogits.of(geometry, qw, kw) is not None
        assert TileLogits.of(geometry, qw.requires_grad_(), kw) is None
    with torch.no_grad():
        assert TileLogits.of(geometry, qw.bfloat16(), kw.bfloat16()) is None
        assert TileLogits.of(geometry, qw, kw.double()) is None
        for name, options in [
            ("adaptive_product", {}),
            ("cone", {}),
            ("kappa", {"kappa": [-1.0, 0.5]}),
        ]:
            other = make_geometry(name, DIM, heads=2, **options)
            oq, ok = _witnesses(other, 5, 9, torch.float32, (2,))
            assert TileLogits.of(other, oq, ok) is None
            torch.testing.assert_close(other.score(oq, ok), _recorded_score(other, oq, ok))
