"""Cone (docs/mathematics.md 2) and graded (docs/mathematics.md 3) attention against direct float64
implementations of their formulas; the penumbral branches, the out-of-cone symmetry, umbral ==
Laplacian at equal heights; graded == dot product at unit weights; exact graded lifts; the cone
candidate method (height bands) and its recall; sparse == dense; gradients; the graded training
aids."""

from __future__ import annotations

import math

import mpmath
import pytest
import torch
from torch.nn import functional as F

from rewa.attention import (
    Cone,
    GeometricAttention,
    Graded,
    dense_attention,
    make_geometry,
    penumbral_height,
    sparse_attention,
)
from rewa.attention.geometry import lift_similarity
from rewa.index import (
    BandedIndex,
    IndexSettings,
    KeyClusters,
    build_index,
    exact_topk,
    retrieval_attention,
    tail_attention,
    topk_recall,
)
from rewa.research import (
    annealed_lambda,
    grade_inputs,
    grade_learning_rate_bound,
    grade_regularizer,
    graded_loss,
    graded_positional_encoding,
    head_coordination_loss,
    sinusoidal_encoding,
)
from tests.support import ivf_list_attention

DIM = 6


def _data(n_queries=5, n_keys=40, dim=DIM, heads=None, seed=0, dv=3):
    generator = torch.Generator().manual_seed(seed)
    batch = () if heads is None else (heads,)
    q = torch.randn(*batch, n_queries, dim, generator=generator, dtype=torch.float64)
    k = torch.randn(*batch, n_keys, dim, generator=generator, dtype=torch.float64)
    v = torch.randn(*batch, n_keys, dv, generator=generator, dtype=torch.float64)
    return q, k, v


# -- cone: direct formulas --------------------------------------------------------------------


def _map(x: list[float], kind: str, light: float, height_scale: float) -> tuple[list, float]:
    t = x[-1] / height_scale
    y = math.exp(t) if kind == "umbral" else light / (1 + math.exp(-t))
    return [c * y for c in x[:-1]], y


def _reference_height(u, v, kind: str, r: float) -> tuple[float, bool]:
    """docs/mathematics.md 2 in plain float64 scalars: the cone-root height and whether a cone holds
    both."""
    (ux, uy), (vx, vy) = u, v
    distance = math.dist(ux, vx)
    if kind == "umbral":
        return max(uy, vy, distance / (2 * math.sinh(r)) + (uy + vy) / 2), True
    a, b = math.sqrt(r * r - uy * uy), math.sqrt(r * r - vy * vy)
    if distance <= a or (distance - a) ** 2 + vy * vy < r * r:
        return max(uy, vy, math.sqrt(r * r - ((a + b - distance) / 2) ** 2)), True
    centre = (distance**2 + uy * uy - vy * vy) / (2 * distance)
    return math.sqrt(centre**2 + vy * vy), False


@pytest.mark.parametrize("kind", ["penumbral", "umbral"])
def test_cone_logits_follow_the_formula_with_per_head_parameters(kind):
    r = [0.8, 1.3] if kind == "penumbral" else [0.1, 0.4]
    light = [0.7, 1.3] if kind == "penumbral" else None
    g = Cone(DIM, heads=2, kind=kind, r=r, gamma=[0.5, 2.0], light_height=light, height_scale=2.0)
    g = g.double()
    q, k, _ = _data(heads=2)
    q, k = 2 * q, 2 * k  # far enough apart that both penumbral branches occur
    expected = torch.zeros(2, q.shape[1], k.shape[1], dtype=torch.float64)
    branches = set()
    # The parameters as stored (float32 values of 0.8, 1.3, ... widened to float64).
    r, gamma = g.r.tolist(), g.gamma.tolist()
    light = g.light_height.tolist() if light else [0.0, 0.0]
    assert gamma == pytest.approx([0.5, 2.0])
    for head in range(2):
        for i in range(q.shape[1]):
            u = _map(q[head, i].tolist(), kind, light[head], 2.0)
            for j in range(k.shape[1]):
                v = _map(k[head, j].tolist(), kind, light[head], 2.0)
                height, exists = _reference_height(u, v, kind, r[head])
                branches.add(exists)
                expected[head, i, j] = -gamma[head] * height
    torch.testing.assert_close(g.logits(q, k), expected, rtol=1e-10, atol=1e-10)
    gathered = k.unsqueeze(1).expand(2, q.shape[1], *k.shape[1:])
    torch.testing.assert_close(g.logits_at(q, gathered), expected, rtol=1e-10, atol=1e-10)
    if kind == "penumbral":
        assert branches == {True, False}


def test_penumbral_branches_and_out_of_cone_symmetry():
    r = torch.tensor(1.0, dtype=torch.float64)
    # Both heights 0.5, so a = b = sqrt(0.75): a common cone iff (D - a)^2 + 0.25 < 1, i.e.
    # D < 2a; D = 0.3 lies inside, D = 3 outside.
    y = torch.tensor([0.5], dtype=torch.float64)
    for distance, exists in ((0.3, True), (3.0, False)):
        d = torch.tensor([distance], dtype=torch.float64)
        height = penumbral_height(d, y, y, r).item()
        expected, branch = _reference_height(([0.0], 0.5), ([distance], 0.5), "penumbral", 1.0)
        assert branch is exists and height == pytest.approx(expected, rel=1e-12)
    # Out of cone, the expression is symmetric in u and v.
    generator = torch.Generator().manual_seed(1)
    u_y = torch.rand(500, generator=generator, dtype=torch.float64) * 0.9 + 0.05
    v_y = torch.rand(500, generator=generator, dtype=torch.float64) * 0.9 + 0.05
    distance = torch.rand(500, generator=generator, dtype=torch.float64) * 6 + 2.0
    a = (1 - u_y**2).sqrt()
    outside = (distance > a) & ((distance - a) ** 2 + v_y**2 >= 1)
    assert outside.sum() > 400
    forward = penumbral_height(distance, u_y, v_y, r)[outside]
    backward = penumbral_height(distance, v_y, u_y, r)[outside]
    torch.testing.assert_close(forward, backward, rtol=1e-12, atol=1e-12)
    # On the boundary of the existence region both expressions give r (continuity).
    a = math.sqrt(1 - 0.25)
    on_boundary = torch.tensor([a + math.sqrt(1 - 0.25)], dtype=torch.float64)
    assert penumbral_height(on_boundary, y, y, r).item() == pytest.approx(1.0, abs=1e-9)


def test_umbral_attention_at_equal_heights_is_the_laplacian_kernel():
    r, gamma, height = 0.3, 1.7, 0.8
    g = Cone(DIM, kind="umbral", r=r, gamma=gamma).double()
    generator = torch.Generator().manual_seed(2)
    qx = torch.randn(4, DIM - 1, generator=generator, dtype=torch.float64)
    kx = torch.randn(30, DIM - 1, generator=generator, dtype=torch.float64)
    qw = torch.cat([qx, torch.full((4, 1), height, dtype=torch.float64)], dim=-1)
    kw = torch.cat([kx, torch.full((30, 1), height, dtype=torch.float64)], dim=-1)
    attention = torch.softmax(g.score(qw, kw), dim=-1)
    gamma_prime = gamma / (2 * math.sinh(r))
    laplacian = torch.exp(-gamma_prime * torch.cdist(qx, kx))
    torch.testing.assert_close(attention, laplacian / laplacian.sum(-1, keepdim=True))


def test_cone_maps_and_parameter_checks():
    x = torch.tensor([[0.5, -1.0, 2.0]], dtype=torch.float64)
    umbral = Cone(3, kind="umbral", height_scale=2.0).double()
    torch.testing.assert_close(
        umbral.witness(x), torch.tensor([[0.5 * math.e, -math.e, math.e]]).double()
    )
    penumbral = Cone(3, kind="penumbral", r=2.0, light_height=1.5).double()
    s = 1 / (1 + math.exp(-2.0))
    torch.testing.assert_close(
        penumbral.witness(x), torch.tensor([[0.75 * s, -1.5 * s, 1.5 * s]]).double()
    )
    # Below the light source (up to float32 rounding of the saturated sigmoid).
    assert penumbral.witness(10 * torch.randn(100, 3)).select(-1, -1).max() <= 1.5
    assert isinstance(Cone(4).log_gamma, torch.nn.Parameter)
    assert not isinstance(Cone(4, learn_gamma=False).log_gamma, torch.nn.Parameter)
    for options in (
        {"kind": "conic"},
        {"r": -1.0},
        {"r": [1.0, 2.0, 3.0]},
        {"light_height": 2.0},  # above the light source r = 1
        {"kind": "umbral", "light_height": 0.5},
        {"gamma": 0.0},
        {"height_scale": 0.0},
    ):
        with pytest.raises(ValueError):
            make_geometry("cone", 4, heads=2, **options)
    with pytest.raises(ValueError, match="dim >= 2"):
        Cone(1)


@pytest.mark.parametrize("kind", ["penumbral", "umbral"])
def test_cone_sparse_equals_dense_and_gradients_are_finite(kind):
    g = Cone(DIM, heads=2, kind=kind, r=[1.0, 1.5] if kind == "penumbral" else 0.2).double()
    q, k, v = (t.requires_grad_() for t in _data(heads=2))
    # A key horizontally on top of a query (D = 0) and one straight above it.
    with torch.no_grad():
        k[0, 0] = q[0, 0]
        k[0, 1, :-1] = q[0, 1, :-1]
    out, lse = dense_attention(q, k, v, g)
    every = torch.arange(40).expand(2, 5, 40)
    sparse = sparse_attention(q, k, v, g, every, 40)
    torch.testing.assert_close(sparse[0], out, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(sparse[1], lse, rtol=1e-9, atol=1e-10)
    (out.square().sum() + lse.sum()).backward()
    for tensor in (q, k, v, *g.parameters()):
        assert tensor.grad is not None and torch.isfinite(tensor.grad).all()


# -- cone: candidate method -------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["penumbral", "umbral"])
def test_cone_height_bands_find_the_exact_top_k(kind):
    """Cone scores have no exact lift; searching height bands on the candidate lift does. On
    4096 random keys (d = 16), one band misses top-32 keys that 8 bands find."""
    g = Cone(16, kind=kind)
    assert not g.exact_lift
    generator = torch.Generator().manual_seed(3)
    keys = torch.randn(4096, 16, generator=generator)
    queries = torch.randn(128, 16, generator=generator)
    truth = exact_topk(queries, keys, g, 32)
    qw = g.witness(queries)
    recall = {}
    for bands in (1, 8):
        index = build_index(keys, g, "flat", bands=bands)
        assert isinstance(index, BandedIndex) and index.ntotal == 4096
        assert sorted(torch.cat(index.members).tolist()) == list(range(4096))
        _, found = index.search(qw, 32)
        recall[bands] = topk_recall(found, truth).mean().item()
    assert recall[8] >= 0.97, recall
    assert recall[8] > recall[1], recall
    with pytest.raises(TypeError, match="height bands"):
        build_index(keys, g, "lsh")


def test_cone_retrieval_attention_and_its_limits():
    g = Cone(8, kind="penumbral").double()
    q, k, v = _data(n_queries=6, n_keys=300, dim=8)
    index = build_index(k, g, "flat", bands=4)
    # Every key a candidate of every band: sparse attention over the exact top K.
    out, lse = retrieval_attention(q, k, v, g, top_k=300, index=index, per_query=300)
    expected = dense_attention(q, k, v, g)
    torch.testing.assert_close(out, expected[0], rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(lse, expected[1], rtol=1e-9, atol=1e-10)
    with pytest.raises(ValueError, match="no exact lift"):
        retrieval_attention(q, k, v, g, index="clusters")
    with pytest.raises(ValueError, match="exact lift; use GeometryIndex"):
        BandedIndex(make_geometry("dot", 8), IndexSettings())


# -- graded: formulas and properties ----------------------------------------------------------


def _weights(grades: list[float], kind: str, lam: float) -> list[float]:
    return [abs(g) + 1 if kind == "linear" else lam ** abs(g) for g in grades]


@pytest.mark.parametrize("kind", ["linear", "exponential"])
@pytest.mark.parametrize("variant", ["scores", "queries_keys", "multi_head", "values"])
def test_graded_attention_follows_the_formula(kind, variant):
    generator = torch.Generator().manual_seed(4)
    rows = 2 if variant == "multi_head" else 1
    grades = torch.rand(rows, DIM, generator=generator, dtype=torch.float64) * 2
    g = Graded(DIM, heads=2, kind=kind, variant=variant, lam=1.7, grades=grades).double()
    q, k, v = _data(heads=2, dv=DIM)
    expected_out = torch.zeros(2, q.shape[1], DIM, dtype=torch.float64)
    expected_lse = torch.zeros(2, q.shape[1], dtype=torch.float64)
    stored = g.grades.detach()  # float32 values widened to float64
    for head in range(2):
        w = _weights(stored[head if rows == 2 else 0].tolist(), kind, 1.7)
        for i in range(q.shape[1]):
            logits = []
            for j in range(k.shape[1]):
                total = 0.0
                for c in range(DIM):
                    factor = {"scores": w[c], "values": 1.0}.get(variant, w[c] ** 2)
                    total += q[head, i, c].item() * factor * k[head, j, c].item()
                logits.append(total / math.sqrt(DIM))
            top = max(logits)
            lse = top + math.log(sum(math.exp(x - top) for x in logits))
            expected_lse[head, i] = lse
            for j, logit in enumerate(logits):
                value = v[head, j] * (
                    torch.tensor(w, dtype=torch.float64) if variant == "values" else 1
                )
                expected_out[head, i] += math.exp(logit - lse) * value
    out, lse = dense_attention(q, k, v, g)
    torch.testing.assert_close(out, expected_out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, expected_lse, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kind", ["linear", "exponential"])
@pytest.mark.parametrize("variant", ["scores", "queries_keys", "multi_head", "values"])
def test_graded_equals_dot_product_when_every_weight_is_one(kind, variant):
    g = Graded(DIM, heads=2, kind=kind, variant=variant).double()  # grades 0: weights 1
    dot = make_geometry("dot", DIM).double()
    q, k, v = _data(heads=2, dv=DIM)
    for got, expected in zip(
        dense_attention(q, k, v, g), dense_attention(q, k, v, dot), strict=True
    ):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    # lambda = 1 makes every exponential weight 1 whatever the grades (lambda annealing's start).
    annealed = Graded(DIM, kind="exponential", variant=variant, lam=1.0, grades=3.0).double()
    q, k, v = _data(dv=DIM)
    for got, expected in zip(
        dense_attention(q, k, v, annealed), dense_attention(q, k, v, dot), strict=True
    ):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("variant", ["scores", "queries_keys", "multi_head", "values"])
def test_graded_lift_is_exact_and_sparse_and_tail_equal_dense(variant):
    generator = torch.Generator().manual_seed(5)
    grades = torch.rand(1, DIM, generator=generator, dtype=torch.float64)
    g = Graded(DIM, kind="exponential", variant=variant, lam=3.0, grades=grades).double()
    q, k, v = _data(dv=DIM)
    qw, kw = g.witness(q), g.witness(k)
    (query_lift,), (key_lift,) = g.lift(qw, "query"), g.lift(kw, "key")
    similarity = lift_similarity(query_lift, key_lift)
    torch.testing.assert_close(sum(g.similarity_logits(qw, [similarity])), g.score(qw, kw))
    assert torch.equal(similarity.argsort(-1), g.score(qw, kw).argsort(-1))
    expected = dense_attention(q, k, v, g)
    every = torch.arange(40).expand(5, 40)
    with torch.no_grad():
        clusters = KeyClusters.build(kw, v, g, n_clusters=4)
    results = [
        sparse_attention(q, k, v, g, every, 40),
        tail_attention(q, clusters, budget=1.0),
        retrieval_attention(q, k, v, g, top_k=40, index="flat", per_query=40),
        ivf_list_attention(q, v, g, build_index(k, g, "ivf", nlist=2, nprobe=2)),
    ]
    for out, lse in results:
        torch.testing.assert_close(out, expected[0], rtol=1e-9, atol=1e-10)
        torch.testing.assert_close(lse, expected[1], rtol=1e-9, atol=1e-10)


def test_graded_gradients_reach_the_grades_and_the_module_trains_them():
    g = Graded(DIM, heads=2, kind="exponential", variant="multi_head", grades=0.5).double()
    q, k, v = (t.requires_grad_() for t in _data(heads=2))
    out, lse = dense_attention(q, k, v, g)
    (out.square().sum() + lse.sum()).backward()
    for tensor in (q, k, v, g.grades):
        assert tensor.grad is not None and torch.isfinite(tensor.grad).all()
    assert g.grades.grad.abs().sum() > 0
    module = GeometricAttention(16, 2, "graded", geometry_options={"variant": "values"})
    module(torch.randn(2, 9, 16)).square().sum().backward()
    assert module.geometry.grades.grad is not None


def test_graded_values_need_the_value_dim_of_the_keys():
    g = Graded(DIM, variant="values")
    q, k, v = _data(dv=3)
    with pytest.raises(ValueError, match="value dim"):
        dense_attention(q.float(), k.float(), v.float(), g)


# -- graded: training aids --------------------------------------------------------------------


def test_graded_inputs_and_positional_encodings():
    x = torch.tensor([[1.0, 0.5, 0.1]])
    weights = torch.tensor([1.0, 1.1, 1.2])
    torch.testing.assert_close(grade_inputs(x, weights), torch.tensor([[1.0, 0.55, 0.12]]))
    normalised = grade_inputs(x, weights, normalise=True)  # seed example 5.20
    torch.testing.assert_close(normalised, torch.tensor([[0.871, 0.479, 0.105]]), atol=1e-3, rtol=0)
    positions = torch.arange(5)
    pe = sinusoidal_encoding(positions, 4)
    assert pe[3, 0].item() == pytest.approx(math.sin(3.0))
    assert pe[3, 3].item() == pytest.approx(math.cos(3 / 100.0))
    linear = graded_positional_encoding(positions, 4, alpha=0.1)
    torch.testing.assert_close(linear, (1 - 0.1 * positions.float()).unsqueeze(-1) * pe)
    exponential = graded_positional_encoding(positions, 4, alpha=0.5, kind="exponential", lam=2.0)
    torch.testing.assert_close(exponential, (2.0 ** (-0.5 * positions.float())).unsqueeze(-1) * pe)
    with pytest.raises(ValueError):
        graded_positional_encoding(positions, 4, alpha=0.0)


def test_grade_regularisers_schedule_loss_and_learning_rate_bound():
    grades = torch.tensor([[1.0, 2.0], [3.0, 0.0]])
    assert grade_regularizer(grades, 0.5).item() == pytest.approx(0.5 * 14)
    # mean (2, 1): deviations (-1, 1) and (1, -1).
    assert head_coordination_loss(grades).item() == pytest.approx(4.0)
    with pytest.raises(ValueError):
        head_coordination_loss(grades[0])
    assert annealed_lambda(0, 100, 3.0) == 1.0
    assert annealed_lambda(50, 100, 3.0) == pytest.approx(2.0)
    assert annealed_lambda(200, 100, 3.0) == 3.0
    prediction = torch.tensor([[0.0, 1.0], [1.0, 1.0]])
    target = torch.tensor([[1.0, 1.0], [1.0, 3.0]])
    weights = torch.tensor([2.0, 0.5])
    assert graded_loss(prediction, target, weights).item() == pytest.approx(2 * 1 + 0.5 * 4)
    probability = torch.tensor([[0.8, 0.9]])
    expected = -(math.log(0.8) * 2 + math.log(0.9) * 0.5)
    assert graded_loss(probability, torch.ones(1, 2), weights, F.binary_cross_entropy).item() == (
        pytest.approx(expected)
    )
    assert grade_learning_rate_bound(grades, "exponential", 2.0) == pytest.approx(
        1 / (8 * math.log(2))
    )
    assert grade_learning_rate_bound(grades, "exponential", 1.0) == math.inf
    assert grade_learning_rate_bound(grades, "linear") == pytest.approx(0.25)


def test_lambda_annealing_drives_the_geometry():
    g = Graded(4, kind="exponential", grades=[0.0, 1.0, 2.0, 3.0], lam=1.0)
    torch.testing.assert_close(g.weights(), torch.ones(1, 4))
    g.set_lambda(annealed_lambda(10, 10, 2.0))
    torch.testing.assert_close(g.weights(), torch.tensor([[1.0, 2.0, 4.0, 8.0]]))
    with pytest.raises(ValueError):
        g.set_lambda(0.5)
    for options in ({"kind": "cubic"}, {"variant": "keys"}, {"lam": 0.9}, {"grades": [1.0, 2.0]}):
        with pytest.raises(ValueError):
            make_geometry("graded", 4, **options)


@pytest.mark.parametrize("kind", ["penumbral", "umbral"])
def test_cone_attention_module_trains_gamma(kind):
    module = GeometricAttention(16, 2, "cone", geometry_options={"kind": kind, "r": [1.0, 2.0]})
    module(torch.randn(2, 9, 16)).square().sum().backward()
    gamma = module.geometry.log_gamma
    assert gamma.shape == (2,) and gamma.grad is not None and torch.isfinite(gamma.grad).all()


def _penumbral_height_mp(distance: float, u_y: float, v_y: float, r: float) -> float:
    """The penumbral height inside a common cone, at 50 digits (docs/mathematics.md 2)."""
    with mpmath.workdps(50):
        d, u, v, radius = (mpmath.mpf(x) for x in (distance, u_y, v_y, r))
        a, b = mpmath.sqrt(radius**2 - u**2), mpmath.sqrt(radius**2 - v**2)
        return float(max(u, v, mpmath.sqrt(radius**2 - ((a + b - d) / 2) ** 2)))


@pytest.mark.parametrize("scale", [1e-13, 1e-9, 1e-5, 1e-2, 0.3])
def test_penumbral_heights_are_accurate_at_every_scale(scale):
    """Tiny heights and distances lost digits to `r^2 - ((a + b - D)/2)^2` (relative error 3e-5
    in float64 at heights near 1e-13); the form `s (2r - s)` keeps float64's precision."""
    generator = torch.Generator().manual_seed(11)
    u_y, v_y, distance = (
        scale * (0.1 + 0.9 * torch.rand(200, generator=generator, dtype=torch.float64))
        for _ in range(3)
    )
    r = torch.tensor(1.0, dtype=torch.float64)
    heights = penumbral_height(distance, u_y, v_y, r)
    expected = torch.tensor(
        [
            _penumbral_height_mp(*values, 1.0)
            for values in zip(*(t.tolist() for t in (distance, u_y, v_y)), strict=True)
        ],
        dtype=torch.float64,
    )
    torch.testing.assert_close(heights, expected, rtol=1e-13, atol=0)
