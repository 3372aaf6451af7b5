"""Cluster-tail attention (docs/mathematics.md 6 "Tail estimate"): exactness when every cluster is
visited, the limits where the estimator is exact, and lower error than exact-only sparse
attention."""

import io

import numpy as np
import pytest
import torch

from benchmarks.data import clustered, tree
from rewa.attention import allocator, dense_attention, make_geometry
from rewa.attention.geometry import lift_similarity
from rewa.index import (
    KeyClusters,
    estimate_clusters,
    output_error,
    quality,
    retrieval_attention,
    tail_attention,
    tail_attention_with_reads,
)
from rewa.index.clusters import _batch_statistics, _eigh, _leading_eigh
from rewa.index.tail import default_query_block, select_clusters, shift_dtype
from rewa.index.tail import unread as unread_module
from rewa.index.tail.exact import (
    _blocked_partials,
    _merge_partials,
    _per_cluster_partials,
    _shared_reference_attention,
    _visited_attention,
)
from rewa.index.tail.selection import MAX_ARGMAX_WIDTH, _most_massive
from tests.support import GEOMETRY_NAMES, build_geometry

TAIL_GEOMETRIES = ["dot", "euclidean", "sphere", "poincare", "kappa", "product"]


# A key that 12 tokens of MiniLM's layer 0 share (head 8, float32).
SHARED_KEY = [
    2.783693552017212,
    -1.3515067100524902,
    -1.5980989933013916,
    -0.1678709238767624,
    -0.7968242764472961,
    1.1478990316390991,
    0.558678388595581,
    0.6871234178543091,
    -0.745476245880127,
    0.5544315576553345,
    2.8982083797454834,
    -2.454514980316162,
    1.0853325128555298,
    1.4613651037216187,
    -1.4593546390533447,
    0.4255824089050293,
    2.842073678970337,
    -0.19922152161598206,
    0.7742428183555603,
    0.5956282615661621,
    1.0892069339752197,
    1.2481935024261475,
    -2.0727391242980957,
    1.4067448377609253,
    2.0397462844848633,
    2.230895757675171,
    -0.060494571924209595,
    0.9570258259773254,
    0.22985927760601044,
    -2.5958974361419678,
    -0.7737032771110535,
    1.4220484495162964,
]


def _inputs(n_keys=400, n_queries=30, dim=8, dv=5, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(n_queries, dim, generator=generator, dtype=torch.float64) * 0.6
    k = torch.randn(n_keys, dim, generator=generator, dtype=torch.float64) * 0.6
    v = torch.randn(n_keys, dv, generator=generator, dtype=torch.float64)
    return q, k, v


def _clusters(k, v, geometry, **options):
    with torch.no_grad():
        return KeyClusters.build(geometry.witness(k), v, geometry, **options)


@pytest.mark.parametrize(
    ("name", "power"),
    [("dot", None)] + [(name, p) for name in GEOMETRY_NAMES if name != "dot" for p in (1, 2)],
)
def test_logits_are_functions_of_the_lift_similarities(name, power):
    options = {} if power is None else {"power": power}
    g = build_geometry(name, 8, **options)
    q, k, _ = _inputs(n_keys=9, n_queries=7)
    qw, kw = g.witness(q), g.witness(k)
    similarities = [
        lift_similarity(a, b) for a, b in zip(g.lift(qw, "query"), g.lift(kw, "key"), strict=True)
    ]
    torch.testing.assert_close(
        sum(g.similarity_logits(qw, similarities)), g.score(qw, kw), rtol=1e-10, atol=1e-10
    )


@pytest.mark.parametrize("name", TAIL_GEOMETRIES)
def test_visiting_every_cluster_is_dense_attention(name):
    g = build_geometry(name, 8)
    q, k, v = _inputs()
    clusters = _clusters(k, v, g, n_clusters=12)
    with torch.no_grad():
        out, lse, keys_read = tail_attention_with_reads(q, clusters, budget=1.0)
        expected_out, expected_lse = dense_attention(q, k, v, g)
    torch.testing.assert_close(out, expected_out, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lse, expected_lse, rtol=1e-10, atol=1e-12)
    assert (keys_read == 400).all()


@pytest.mark.parametrize("name", TAIL_GEOMETRIES)
def test_the_estimate_is_exact_for_one_key_per_cluster(name):
    """Zero variance: every cluster's estimate is its key's exact term, with nothing read."""
    g = build_geometry(name, 8)
    q, k, v = _inputs(n_keys=40)
    clusters = _clusters(k, v, g, n_clusters=40)
    assert (clusters.counts == 1).all()
    with torch.no_grad():
        out, lse, keys_read = tail_attention_with_reads(q, clusters, budget=0.0)
        expected_out, expected_lse = dense_attention(q, k, v, g)
    assert (keys_read == 0).all()
    torch.testing.assert_close(out, expected_out, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(lse, expected_lse, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("name", TAIL_GEOMETRIES)
def test_the_estimate_is_exact_for_clusters_of_identical_keys(name):
    g = build_geometry(name, 8)
    q, centres, _ = _inputs(n_keys=6)
    k = centres.repeat_interleave(25, dim=0)
    v = torch.randn(150, 4, dtype=torch.float64)
    clusters = _clusters(k, v, g, n_clusters=12)
    for first, last in zip(
        clusters.offsets[:-1].tolist(), clusters.offsets[1:].tolist(), strict=True
    ):
        # k-means may split a group of identical keys, never mix two
        assert (clusters.keys_w[first:last] == clusters.keys_w[first:last][:1]).all()
    with torch.no_grad():
        out, lse = tail_attention(q, clusters, budget=0.0)
        expected_out, expected_lse = dense_attention(q, k, v, g)
    torch.testing.assert_close(out, expected_out, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(lse, expected_lse, rtol=1e-9, atol=1e-9)


def test_the_dot_product_estimate_is_unbiased_for_gaussian_keys_and_values():
    """One large cluster of jointly Gaussian keys and values: the second-order log-mass and the
    first-order value correction are the exact Gaussian expectations, so the estimate converges
    to the exact attention as the cluster grows (here 200 000 keys)."""
    generator = torch.Generator().manual_seed(3)
    dim, n = 6, 200_000
    mixing = torch.randn(dim, dim, generator=generator, dtype=torch.float64) * 0.3
    k = torch.randn(n, dim, generator=generator, dtype=torch.float64) @ mixing + 0.5
    projection = torch.randn(dim, 3, generator=generator, dtype=torch.float64)
    v = k @ projection + 0.1 * torch.randn(n, 3, generator=generator, dtype=torch.float64)
    q = torch.randn(20, dim, generator=generator, dtype=torch.float64)
    g = make_geometry("dot", dim).double()
    # No outlier cluster: the estimator itself, over every key, is what is tested.
    clusters = _clusters(k, v, g, n_clusters=1, rank=dim, outliers=0)
    with torch.no_grad():
        out, lse = tail_attention(q, clusters, budget=0.0)
        expected_out, expected_lse = dense_attention(q, k, v, g)
    assert (lse - expected_lse).abs().max() < 2e-3
    error = output_error(out, expected_out)  # what is left is the sample's own noise
    assert error.median() < 2e-3 and error.max() < 2e-2
    # The value mean alone (no cross-covariance correction) is clearly worse.
    mean_only = clusters.value_mean.expand_as(out)
    assert output_error(mean_only, expected_out).median() > 0.1


def test_window_and_sink_keys_are_read_exactly_and_not_estimated_twice():
    g = build_geometry("dot", 8)
    q, k, v = _inputs()
    clusters = _clusters(k, v, g, n_clusters=10)
    with torch.no_grad():
        expected = dense_attention(q, k, v, g)
        every = tail_attention(q, clusters, budget=0.0, always=torch.arange(400))
        full = retrieval_attention(
            q, k, v, g, index=clusters, budget=1.0, tail=True, window=50, sinks=4
        )
        keys_read = tail_attention_with_reads(
            q, clusters, budget=0.1, always=torch.arange(30)
        ).keys_read
    for result in (every, full):
        torch.testing.assert_close(result[0], expected[0], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(result[1], expected[1], rtol=1e-10, atol=1e-12)
    # 10 keys of budget beside the 30 always read: less than any cluster, so each query reads
    # its most massive cluster besides them, and nothing else.
    assert (keys_read >= 30).all() and (keys_read <= 30 + clusters.counts.max()).all()
    assert (keys_read > 30).all()


@pytest.mark.parametrize("name", ["dot", "poincare", "product"])
def test_the_cpu_and_gpu_engines_of_the_exact_part_agree(name):
    # The GPU path (one batched product over key blocks) is chosen on CUDA tensors only; here
    # both engines run on the CPU on the same pairs, with window keys masked in some clusters.
    g = build_geometry(name, 8)
    q, k, v = _inputs(n_keys=700)
    clusters = _clusters(k, v, g, n_clusters=9)  # clusters larger than one 128-key block
    qw = g.witness(q)
    generator = torch.Generator().manual_seed(1)
    pair_query = torch.randint(0, 30, (60,), generator=generator)
    pair_cluster = torch.randint(0, 9, (60,), generator=generator)
    pairs = torch.stack([pair_query, pair_cluster], -1).unique(dim=0)
    is_always = torch.zeros(700, dtype=torch.bool)
    is_always[torch.randperm(700, generator=generator)[:50]] = True
    with torch.no_grad():
        results = [
            _merge_partials(30, *engine(qw, clusters, pairs[:, 0], pairs[:, 1], is_always))
            for engine in (_per_cluster_partials, _blocked_partials)
        ]
        # Reference: dense attention over each query's visited keys, minus the masked ones.
        visited = torch.zeros(30, 700, dtype=torch.bool)
        for query, cluster in pairs.tolist():
            visited[query, clusters.offsets[cluster] : clusters.offsets[cluster + 1]] = True
        logits = g.score(qw, clusters.keys_w).masked_fill(~visited | is_always, float("-inf"))
        expected_lse = logits.logsumexp(-1)
        expected_out = torch.softmax(logits, -1).nan_to_num() @ clusters.values
    for out, lse in results:
        torch.testing.assert_close(lse, expected_lse, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(out, expected_out, rtol=1e-10, atol=1e-12)
    assert not torch.isfinite(results[0][1]).all()  # some queries visit nothing: (0, -inf)


@pytest.mark.parametrize("make_data", [clustered, tree], ids=["clustered", "tree"])
def test_tail_beats_exact_only_sparse_attention_at_the_same_keys_read(make_data):
    data = make_data(8192)
    g = data.geometry()
    queries = data.q[:512]
    with torch.no_grad():
        reference = dense_attention(queries, data.k, data.v, g)
        clusters = KeyClusters.build(g.witness(data.k), data.v, g, n_clusters=256)
        results = {}
        for tail in (False, True):
            result = tail_attention_with_reads(queries, clusters, budget=0.02, tail=tail)
            results[tail] = quality(result.out, result.lse, *reference, result.keys_read, 8192)
    print(f"\n{data.name} N=8192, 2% of keys: exact-only {results[False]}, tail {results[True]}")
    assert results[True]["keys_read_frac"] == results[False]["keys_read_frac"] <= 0.02
    assert results[True]["err_median"] < results[False]["err_median"]
    assert results[True]["lse_abs_err_median"] < results[False]["lse_abs_err_median"]


def test_the_value_shift_runs_in_bfloat16_only_on_a_gpu_that_multiplies_it_natively(
    monkeypatch,
):
    """On the CPU the shift keeps the context's dtype, also where the CPU multiplies bfloat16:
    a decode step's compiled shift runs in it, and a query must get the same answer alone and
    in a batch."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert shift_dtype(torch.float32, cpu) == torch.float32
    assert shift_dtype(torch.float64, cpu) == torch.float64
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)
    assert shift_dtype(torch.float32, cuda) == torch.bfloat16
    assert shift_dtype(torch.float64, cuda) == torch.float64  # exactness tests stay exact
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: False)
    assert shift_dtype(torch.float32, cuda) == torch.float32


def _bfloat16_shift(bfloat16: bool):
    """A `shift_dtype` that picks bfloat16 for float32 (as on a GPU) or never."""
    if not bfloat16:
        return lambda dtype, device: dtype
    return lambda dtype, device: torch.bfloat16 if dtype == torch.float32 else dtype


def test_a_bfloat16_value_shift_changes_the_output_by_far_less_than_the_estimates_error(
    monkeypatch,
):
    """float32 keys in Gaussian blobs, values linear in the keys plus noise (the tail estimate
    is good here: median error under 1 %, exact-only sparse attention's is above 1): the shift
    in bfloat16 moves the output by under a tenth of the float32 result's own error, and
    leaves the log-partition alone (the shift does not enter it)."""
    generator = torch.Generator().manual_seed(0)
    dim, n = 16, 8192
    centres = torch.randn(32, dim, generator=generator)
    k = centres[torch.randint(0, 32, (n,), generator=generator)]
    k = k + 0.5 * torch.randn(n, dim, generator=generator)
    v = k @ torch.randn(dim, 8, generator=generator) + 0.3 * torch.randn(n, 8, generator=generator)
    q = torch.randn(256, dim, generator=generator)
    g = make_geometry("dot", dim)
    with torch.no_grad():
        expected_out, _ = dense_attention(q, k, v, g)
        clusters = KeyClusters.build(g.witness(k), v, g, n_clusters=64)
        results = {}
        for native_bf16 in (False, True):
            monkeypatch.setattr(unread_module, "shift_dtype", _bfloat16_shift(native_bf16))
            results[native_bf16] = tail_attention(q, clusters, budget=0.02)
        exact_only, _ = tail_attention(q, clusters, budget=0.02, tail=False)
    (out32, lse32), (out16, lse16) = results[False], results[True]
    error = output_error(out32, expected_out).median()
    assert error < 0.01 < output_error(exact_only, expected_out).median()
    assert not torch.equal(out32, out16)  # the bfloat16 product really ran
    torch.testing.assert_close(lse16, lse32, rtol=0, atol=0)
    assert output_error(out16, out32).median() < 0.1 * error


def test_keys_read_respect_the_budget():
    """The keys read stay within the budget, but for a query whose most massive cluster alone
    exceeds it: that query reads that cluster only."""
    data = clustered(8192)
    g = data.geometry()
    clusters = KeyClusters.build(g.witness(data.k), data.v, g, n_clusters=256)
    queries = data.q[:64]
    with torch.no_grad():
        log_mass = estimate_clusters(g.witness(queries), clusters).log_mass
    most_massive = clusters.counts[log_mass.masked_fill(clusters.exact_read, -torch.inf).argmax(-1)]
    for budget in (0.0, 0.01, 0.05):
        keys_read = tail_attention_with_reads(queries, clusters, budget=budget).keys_read
        within = keys_read <= budget * 8192
        alone = (keys_read == most_massive) & (most_massive > budget * 8192)
        assert (within | alone).all() if budget > 0 else (keys_read == 0).all()
        if budget == 0.01:
            assert alone.any() and within.any()  # both cases occur
    assert keys_read.float().mean() > 0.5 * 0.05 * 8192


def test_a_budget_below_a_cluster_still_reads_the_most_massive():
    """A budget smaller than the clusters (a short context of wide heads at 1 %: 164 keys,
    clusters of about 300) reads each query's most massive cluster and nothing else; reading
    nothing left the output of sharp attention wrong by its own size (median error 0.98)."""
    data = clustered(16384, d=128)
    g = data.geometry()
    queries = data.q[:128]
    with torch.no_grad():
        # Pieces of the default size (the probes would halve them here, under the budget).
        clusters = KeyClusters.build(g.witness(data.k), data.v, g, probed_pieces=False)
        budget_keys = 0.01 * 16384
        assert (clusters.counts[~clusters.exact_read] > budget_keys).float().mean() > 0.9
        log_mass = estimate_clusters(g.witness(queries), clusters).log_mass
        pair_query, pair_cluster = select_clusters(
            log_mass, clusters.counts, budget_keys, clusters.exact_read
        )
        ordinary = log_mass.masked_fill(clusters.exact_read, float("-inf"))
        most_massive = ordinary.argmax(-1)
        wide = clusters.counts[most_massive] > budget_keys
        for query in wide.nonzero().squeeze(-1).tolist():
            assert pair_cluster[pair_query == query].tolist() == [most_massive[query].item()]
        out = tail_attention_with_reads(queries, clusters, budget=0.01).out
        expected = dense_attention(queries, data.k, data.v, g)[0]
    assert output_error(out, expected).median() < 1e-3


def test_clusters_serialise_round_trip():
    g = build_geometry("poincare", 8)
    q, k, v = _inputs()
    clusters = _clusters(k, v, g, n_clusters=7, rank=3, outliers=0.02)
    assert clusters.exact_read.any()
    restored = KeyClusters.from_bytes(clusters.to_bytes(), g)
    for name in ("order", "offsets", "keys_w", "factor", "value_cross", "radius", "exact_read"):
        assert torch.equal(getattr(restored, name), getattr(clusters, name))
    with torch.no_grad():
        first = tail_attention(q, clusters, budget=0.1)
        second = tail_attention(q, restored, budget=0.1)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    stranger = io.BytesIO()
    np.savez(stranger, order=clusters.order.numpy())
    with pytest.raises(ValueError, match=f"format {KeyClusters.FORMAT}, got format 1"):
        KeyClusters.from_bytes(stranger.getvalue(), g)
    stranger = io.BytesIO()
    np.savez(stranger, format=np.array(KeyClusters.FORMAT), order=clusters.order.numpy())
    with pytest.raises(ValueError, match="expected arrays"):
        KeyClusters.from_bytes(stranger.getvalue(), g)


def test_gradients_reach_the_queries():
    g = build_geometry("sphere", 8)
    q, k, v = _inputs()
    clusters = _clusters(k, v, g, n_clusters=10)
    q = q.requires_grad_()
    out, lse = tail_attention(q, clusters, budget=0.05)
    (grad,) = torch.autograd.grad(out.square().sum() + lse.sum(), q)
    assert torch.isfinite(grad).all() and grad.abs().sum() > 0


def test_gradients_pass_through_a_bfloat16_value_shift(monkeypatch):
    """float32 dot product: the query gradient with the shift in bfloat16 is finite and within
    1 % of the float32 shift's (measured: 6e-5)."""
    q, k, v = (x.float() for x in _inputs(n_keys=2000, dim=8))
    g = make_geometry("dot", 8)
    clusters = _clusters(k, v, g, n_clusters=20)
    gradients = {}
    for native_bf16 in (False, True):
        monkeypatch.setattr(unread_module, "shift_dtype", _bfloat16_shift(native_bf16))
        queries = q.clone().requires_grad_()
        out, lse = tail_attention(queries, clusters, budget=0.05)
        (gradients[native_bf16],) = torch.autograd.grad(out.square().sum() + lse.sum(), queries)
    assert torch.isfinite(gradients[True]).all()
    assert not torch.equal(gradients[True], gradients[False])
    assert output_error(gradients[True], gradients[False]).max() < 0.01


@pytest.mark.parametrize("name", TAIL_GEOMETRIES)
def test_the_differentiable_and_the_shared_reference_exact_parts_agree(name):
    """With autograd on, the exact part is one softmax per cluster, merged (for gradients);
    under no_grad every weight of a query is taken relative to one reference and the sums add
    up directly. Same values, window and sink keys included."""
    g = build_geometry(name, 8)
    q, k, v = _inputs()
    clusters = _clusters(k, v, g, n_clusters=10)
    always = torch.tensor([0, 1, 397, 398, 399])
    out, lse = tail_attention(q.requires_grad_(), clusters, budget=0.2, always=always)
    with torch.no_grad():
        out_shared, lse_shared = tail_attention(q, clusters, budget=0.2, always=always)
    assert out.requires_grad and not out_shared.requires_grad
    torch.testing.assert_close(out.detach(), out_shared, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse.detach(), lse_shared, rtol=1e-12, atol=1e-12)


def test_cpu_calls_keep_freed_memory_in_the_process(monkeypatch):
    # The (queries, clusters) temporaries are megabytes each: with glibc's default thresholds
    # they were returned to the system on every call and page-faulted back on the next
    # (1000-2500 minor faults per call on a text head, 0-50 with the tuning).
    calls = []
    monkeypatch.setattr(allocator, "_applied", None)
    monkeypatch.setattr(allocator, "_set_glibc_thresholds", lambda: calls.append(1) or True)
    q, k, v = _inputs()
    clusters = _clusters(k, v, build_geometry("dot", 8), n_clusters=10)
    with torch.no_grad():
        tail_attention(q, clusters, budget=0.2)
        tail_attention(q, clusters, budget=0.2)
    assert calls == [1]


@pytest.mark.parametrize("name", ["dot", "poincare"])
@pytest.mark.parametrize("offset", [-200.0, 0.0, 200.0])
def test_a_reference_too_far_from_the_logits_falls_back_to_the_general_path(name, offset):
    # float32 weights exp(l - reference) overflow for a reference 200 below the logits and
    # underflow for one 200 above; those queries are done again per cluster, and every query
    # gets the exact result. Queries 0-4 visit only window keys: (0, -inf) either way. The dot
    # product's compiled loop takes each query's largest logit as its reference instead of the
    # one given, so none of its queries fails.
    g = build_geometry(name, 8)
    q, k, v = (x.float() for x in _inputs(n_keys=700))
    clusters = _clusters(k, v, g, n_clusters=9)
    qw = g.witness(q)
    generator = torch.Generator().manual_seed(2)
    pairs = torch.stack(
        [
            torch.randint(0, 30, (80,), generator=generator),
            torch.randint(0, 9, (80,), generator=generator),
        ],
        -1,
    ).unique(dim=0)
    pairs = pairs[(pairs[:, 0] >= 5) | (pairs[:, 1] == 0)]
    is_always = torch.zeros(700, dtype=torch.bool)
    is_always[: int(clusters.offsets[1])] = True  # every key of cluster 0
    pair_query, pair_cluster = pairs[:, 0], pairs[:, 1]
    with torch.no_grad():
        expected = _merge_partials(
            30, *_per_cluster_partials(qw, clusters, pair_query, pair_cluster, is_always)
        )
        reference = expected[1].nan_to_num(neginf=0.0) + offset
        _, _, failed = _shared_reference_attention(
            qw, [clusters], pair_query, pair_cluster, [is_always], reference
        )
        out, lse = _visited_attention(qw, clusters, pair_query, pair_cluster, is_always, reference)
    visits_keys = torch.isfinite(expected[1])
    assert not visits_keys[:5].any() and visits_keys[5:].all()
    if offset == 0 or name == "dot":
        assert not failed[visits_keys].any()
    else:
        assert failed[visits_keys].all()
    torch.testing.assert_close(lse, expected[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, expected[0], rtol=1e-5, atol=1e-5)


def test_the_estimates_rank_the_true_cluster_masses():
    """The per-cluster log-mass estimates track the exact per-cluster log-sum-exp."""
    data = clustered(8192)
    g = data.geometry()
    clusters = KeyClusters.build(g.witness(data.k), data.v, g, n_clusters=32)  # the data's 32
    queries = data.q[:256]
    with torch.no_grad():
        estimate = estimate_clusters(queries, clusters).log_mass
        logits = g.logits(queries, data.k)[:, clusters.order]
        exact = torch.stack(
            [
                torch.logsumexp(logits[:, a:b], dim=-1)
                for a, b in zip(
                    clusters.offsets[:-1].tolist(), clusters.offsets[1:].tolist(), strict=True
                )
            ],
            dim=-1,
        )
    finite = torch.isfinite(exact)
    correlation = torch.corrcoef(torch.stack([estimate[finite], exact[finite]]))[0, 1]
    assert correlation > 0.95
    assert (estimate.argmax(-1) == exact.argmax(-1)).float().mean() > 0.9


def test_bad_inputs_are_rejected():
    g = build_geometry("dot", 8)
    q, k, v = _inputs()
    clusters = _clusters(k, v, g, n_clusters=4)
    with pytest.raises(ValueError, match="budget"):
        tail_attention(q, clusters, budget=1.5)
    with pytest.raises(ValueError, match="expected queries"):
        tail_attention(q[:, :4], clusters)
    with pytest.raises(ValueError, match="always ids"):
        tail_attention(q, clusters, always=torch.tensor([400]))
    with pytest.raises(ValueError, match="tail=True needs"):
        retrieval_attention(q, k, v, g, index="ivf", tail=True)
    with pytest.raises(ValueError, match="n_clusters"):
        KeyClusters.build(k, v, g, n_clusters=401)
    with pytest.raises(ValueError, match="same n"):
        KeyClusters.build(k, v[:5], g)
    for outliers in (-0.1, 1.0):
        with pytest.raises(ValueError, match="outliers"):
            KeyClusters.build(k, v, g, outliers=outliers)
    with pytest.raises(ValueError, match="query_block"):
        tail_attention(q, clusters, query_block=0)


def test_the_default_pass_holds_more_queries_where_there_are_fewer_clusters():
    assert default_query_block(1, 1000) == 4096  # capped
    assert default_query_block(1, 5190) == (1 << 23) // 5190  # 1616: the table's elements
    assert default_query_block(8, 5000) == 1024  # floored
    # Queries answer the same whatever pass they fall in.
    g = build_geometry("dot", 8)
    q, k, v = _inputs(n_keys=2000, n_queries=300)
    clusters = _clusters(k, v, g)
    whole = tail_attention(q, clusters, budget=0.05)
    for block in (1, 7, 300):
        torch.testing.assert_close(
            tail_attention(q, clusters, budget=0.05, query_block=block), whole, rtol=1e-9, atol=1e-9
        )


def _planted_outliers(n_keys=2000, n_far=20, dim=8, seed=5):
    """Gaussian keys with `n_far` of them pushed far out (ids `n_keys - n_far` on), values
    Gaussian, queries Gaussian (float64)."""
    generator = torch.Generator().manual_seed(seed)
    k = torch.randn(n_keys, dim, generator=generator, dtype=torch.float64)
    k[n_keys - n_far :] *= 4
    v = torch.randn(n_keys, 4, generator=generator, dtype=torch.float64)
    q = torch.randn(64, dim, generator=generator, dtype=torch.float64)
    return q, k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_most_massive_clusters_are_topks_in_its_order_even_when_finite_entries_run_out(
    dtype,
):
    generator = torch.Generator().manual_seed(0)
    log_mass = torch.randn(64, 40, generator=generator, dtype=dtype)
    for width in (1, 7, 40):
        expected = log_mass.topk(width, dim=-1).indices
        assert torch.equal(_most_massive(log_mass, width), expected)
    # Wider than MAX_ARGMAX_WIDTH: topk's answer (no ties in these draws).
    wide = torch.randn(8, 400, generator=generator, dtype=dtype)
    width = MAX_ARGMAX_WIDTH + 50
    assert torch.equal(_most_massive(wide, width), wide.topk(width, dim=-1).indices)
    # Rows with fewer finite entries than the width: distinct columns, the finite ones first.
    sparse = log_mass.masked_fill(torch.rand(64, 40, generator=generator) < 0.8, float("-inf"))
    finite = torch.isfinite(sparse).sum(-1)
    assert int(finite.min()) < 12 < int(finite.max())
    best = _most_massive(sparse, 12)
    assert all(len(set(row)) == 12 for row in best.tolist())
    torch.testing.assert_close(sparse.gather(1, best), sparse.topk(12, dim=-1).values)


def test_outlier_keys_form_one_cluster_read_after_each_querys_most_massive():
    q, k, v = _planted_outliers()
    g = make_geometry("dot", 8).double()
    coarse = _clusters(k, v, g, n_clusters=8, outliers=0.01)
    assert coarse.exact_read.tolist() == [False] * 8 + [True]
    first, last = coarse.offsets[-2:].tolist()
    assert sorted(coarse.order[first:last].tolist()) == list(range(1980, 2000))
    clusters = _clusters(k, v, g, n_clusters=40, outliers=0.01)  # ~50 keys each
    assert clusters.exact_read.tolist() == [False] * 40 + [True]
    assert int(clusters.counts[-1]) == 20
    with torch.no_grad():
        log_mass = estimate_clusters(g.witness(q), clusters).log_mass
        most_massive = log_mass[:, :40].argmax(-1)
        # A budget that holds every query's most massive cluster, and the 20 outliers after
        # some of them only.
        budget = float(clusters.counts[most_massive].max() + 10)
        pairs = select_clusters(log_mass, clusters.counts, budget, clusters.exact_read)
        visited = {}
        for query, cluster in zip(*(p.tolist() for p in pairs), strict=True):
            visited.setdefault(query, []).append(cluster)
        fits = (clusters.counts[most_massive] + 20 <= budget).tolist()
        assert 0 < sum(fits) < 64  # both cases occur
        for i, top in enumerate(most_massive.tolist()):
            expected = [top, 40] if fits[i] else [top]
            assert visited[i][: len(expected)] == expected
            assert (40 in visited[i]) == fits[i]
        keys_read = tail_attention_with_reads(q, clusters, budget=budget / 2000).keys_read
        assert (keys_read >= 20).all() and (keys_read <= budget).all()
        # A budget that cannot hold them: no query reads them.
        pairs = select_clusters(log_mass, clusters.counts, 10, clusters.exact_read)
        assert 40 not in pairs[1].tolist()
        # Reading everything is still exactly dense attention.
        out, lse = tail_attention(q, clusters, budget=1.0)
        expected_out, expected_lse = dense_attention(q, k, v, g)
    torch.testing.assert_close(out, expected_out, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lse, expected_lse, rtol=1e-10, atol=1e-12)


def test_reading_far_keys_exactly_lowers_the_error_of_heavy_tailed_clusters():
    q, k, v = _planted_outliers()
    g = make_geometry("dot", 8).double()
    with torch.no_grad():
        expected = dense_attention(q, k, v, g)
        errors = {}
        for outliers in (0.0, 0.01):
            clusters = _clusters(k, v, g, n_clusters=40, outliers=outliers)
            result = tail_attention_with_reads(q, clusters, budget=0.05)
            errors[outliers] = quality(result.out, result.lse, *expected, result.keys_read, 2000)
    print(f"\nplanted far keys, 5 % read: without {errors[0.0]}, with {errors[0.01]}")
    # The comparison is at no more keys read with the outliers than without.
    assert errors[0.01]["keys_read_frac"] <= errors[0.0]["keys_read_frac"] <= 0.05
    assert errors[0.01]["err_median"] < 0.5 * errors[0.0]["err_median"]
    assert errors[0.01]["lse_abs_err_median"] < 0.5 * errors[0.0]["lse_abs_err_median"]


def test_a_cluster_of_identical_keys_has_finite_statistics():
    """LAPACK's float32 eigh answered NaN eigenvectors for the covariance of 12 copies of
    `SHARED_KEY` (rounding noise of about 1e-14): that cluster's factor and residual were NaN,
    and so was the output of every query that estimated it (benchmarks/minilm_layers.py
    stopped on it)."""
    shared = torch.tensor(SHARED_KEY).expand(12, -1)
    values = torch.randn(12, 4, generator=torch.Generator().manual_seed(0))
    found = _batch_statistics(
        shared, values, torch.tensor([0]), torch.tensor([12]), 16, [slice(0, 32)], 4
    )
    for name, statistic in found.items():
        assert torch.isfinite(statistic).all(), name
    assert found["factor"].abs().max() < 1e-6 and found["residual"].abs().max() < 1e-12
    # In a context: queries that estimate the cluster get finite answers.
    generator = torch.Generator().manual_seed(0)
    blobs = 12 * torch.randn(7, 32, generator=generator)
    others = blobs.repeat_interleave(60, 0) + torch.randn(420, 32, generator=generator)
    keys = torch.cat([shared, others])
    g = make_geometry("dot", 32)
    clusters = KeyClusters.build(
        keys, torch.randn(len(keys), 4, generator=generator), g, n_clusters=16, outliers=0.0
    )
    own = [
        c
        for c in range(clusters.n_clusters)
        if (clusters.keys_w[clusters.offsets[c] : clusters.offsets[c + 1]] == shared[0]).all()
    ]
    assert len(own) == 1 and int(clusters.counts[own[0]]) == 12
    assert torch.isfinite(clusters.factor).all() and torch.isfinite(clusters.residual).all()
    out, lse = tail_attention(others[::40] / 4, clusters, budget=0.05)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()


def rank_one_covariance() -> torch.Tensor:
    """The covariance of a MiniLM cluster (benchmarks/minilm_layers.py, a tail memory) whose
    keys took two values, as `_eigh` scaled it: `u u^T`, `u` of 11 non-zero entries, every
    entry a power of two. MKL's float32 solver gives up on it ("failed to converge", error
    621); numpy's OpenBLAS and float64 solve it."""
    pattern = torch.zeros(32)
    pattern[[3, 6, 10, 11, 15, 16, 17, 21, 22, 26, 30]] = torch.tensor(
        [1, -2, 1, -2, 2, 1, 1, 0.5, 2, -2, 1]
    )
    return torch.outer(pattern, pattern) / 32


def test_a_rank_one_covariance_the_float32_solver_gives_up_on():
    """Solved, alone and among other clusters' covariances, with the right eigenpair: the
    solver raised for the whole batch, and benchmarks/minilm_layers.py stopped on it."""
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(3, 40, 32, generator=generator)
    others = features.transpose(1, 2) @ features / 40
    batch = torch.cat([others[:1], rank_one_covariance()[None], others[1:]])
    eigenvalues, eigenvectors = _eigh(batch)
    assert torch.isfinite(eigenvalues).all() and torch.isfinite(eigenvectors).all()
    torch.testing.assert_close(eigenvalues[1, -1], torch.tensor(25.25 / 32))
    assert eigenvalues[1, :-1].abs().max() < 1e-6
    top = rank_one_covariance() @ eigenvectors[1, :, -1]
    torch.testing.assert_close(top, eigenvalues[1, -1] * eigenvectors[1, :, -1], atol=1e-6, rtol=0)
    for at, expected in ((0, others[0]), (2, others[1])):
        torch.testing.assert_close(eigenvectors[at] @ eigenvalues[at].diag() @ eigenvectors[at].T,
                                   expected, atol=1e-5, rtol=1e-5)  # fmt: skip


def test_where_the_solver_gives_up_each_covariance_is_solved_on_its_own(monkeypatch):
    """Whatever the solver: where it raises for a batch, the other covariances get the answer
    the batch would have given them, the one it gives up on in float32 its float64 answer, and
    one it gives up on in float64 too no factor (zero eigenvalues, the identity)."""
    generator = torch.Generator().manual_seed(1)
    features = torch.randn(4, 30, 6, generator=generator)
    batch = features.transpose(1, 2) @ features / 30
    # What `_eigh` solves: each covariance over the power of two nearest its trace.
    scale = torch.exp2(torch.log2(batch.diagonal(dim1=-2, dim2=-1).sum(-1)).round())
    scaled = batch / scale[:, None, None]
    eigh = torch.linalg.eigh
    expected = eigh(scaled)

    def refusing(matrices):  # gives up on any input holding scaled[1] (float32) or scaled[3]
        marked = [scaled[1], scaled[3], scaled[3].double()]
        if any((matrices == m).all((-2, -1)).any() for m in marked if m.dtype == matrices.dtype):
            raise torch.linalg.LinAlgError("failed to converge")
        return eigh(matrices)

    monkeypatch.setattr(torch.linalg, "eigh", refusing)
    eigenvalues, eigenvectors = _eigh(batch)
    for at in (0, 2):
        assert torch.equal(eigenvalues[at], expected.eigenvalues[at] * scale[at])
        assert torch.equal(eigenvectors[at], expected.eigenvectors[at])
    in_float64 = eigh(scaled[1].double())
    assert torch.equal(eigenvalues[1], in_float64.eigenvalues.float() * scale[1])
    assert torch.equal(eigenvectors[1], in_float64.eigenvectors.float())
    assert (eigenvalues[3] == 0).all() and torch.equal(eigenvectors[3], torch.eye(6))


def test_a_covariance_whose_eigenvectors_are_not_finite_gets_no_factor(monkeypatch):
    """`_eigh`'s last resort: where the solver still answers something not finite, zero
    eigenvalues and the identity, so that the cluster's factor is 0 and its residual holds its
    whole variance."""
    eigh = torch.linalg.eigh

    def failing(matrices):
        eigenvalues, eigenvectors = eigh(matrices)
        return eigenvalues, eigenvectors.index_fill(0, torch.tensor([1]), float("nan"))

    monkeypatch.setattr(torch.linalg, "eigh", failing)
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(24, 6, generator=generator, dtype=torch.float64)
    found = _batch_statistics(
        features, features[:, :2], torch.tensor([0, 8, 16]), torch.tensor([8, 8, 8]), 8,
        [slice(0, 6)], 2,
    )  # fmt: skip
    for statistic in found.values():
        assert torch.isfinite(statistic).all()
    assert (found["factor"][1] == 0).all() and (found["factor"][[0, 2]] != 0).any()
    centred = features[8:16] - features[8:16].mean(0)
    variance = centred.square().mean(0)
    torch.testing.assert_close(found["residual"][1], variance)


def _covariances(dim: int, spectrum: torch.Tensor, count: int, seed: int) -> torch.Tensor:
    """`count` covariances `(count, dim, dim)` with eigenvalues `spectrum` in random bases."""
    generator = torch.Generator().manual_seed(seed)
    bases = torch.linalg.qr(torch.randn(count, dim, dim, generator=generator)).Q
    return bases @ torch.diag_embed(spectrum.expand(count, dim)) @ bases.transpose(1, 2)


@pytest.mark.parametrize("dim", [33, 64, 129])
def test_subspace_iteration_finds_the_leading_eigenpairs(dim):
    """Rank 4 of D >= 9 features: the leading eigenpairs by subspace iteration are those of
    the full solve where the spectrum has a gap after them; where it decays slowly, with no gap
    anywhere, the pairs found hold at least 95 % of their variance (96-99 % at D = 33-129)."""
    gapped = torch.cat([torch.tensor([9.0, 7.0, 5.0, 3.0]), torch.linspace(0.5, 0.01, dim - 4)])
    found_values, found_vectors = _leading_eigh(_covariances(dim, gapped, 6, 0), 4)
    torch.testing.assert_close(found_values, gapped[:4].flip(0).expand(6, 4), rtol=1e-4, atol=0)
    _, full_vectors = torch.linalg.eigh(_covariances(dim, gapped, 6, 0))
    overlap = (found_vectors.transpose(1, 2) @ full_vectors[..., -4:]).abs()
    torch.testing.assert_close(overlap, torch.eye(4).expand(6, 4, 4), rtol=0, atol=1e-3)
    # A slow decay: eigenvalues from 2 down to 0.2 in even steps, no gap anywhere.
    slow = torch.linspace(2.0, 0.2, dim)
    covariances = _covariances(dim, slow, 6, 1)
    values, vectors = _leading_eigh(covariances, 4)
    held = torch.einsum("bdr,bde,ber->b", vectors, covariances, vectors)
    assert (held >= 0.95 * slow[:4].sum()).all()
    assert (values <= slow[:4].flip(0) * (1 + 1e-5)).all()  # Rayleigh-Ritz values from below


def test_leading_eigenpairs_do_not_depend_on_the_batch():
    """A cluster's factor is the same whatever clusters share its batch (build and extend
    batch them differently): each covariance alone and in a batch, bit for bit."""
    covariances = _covariances(40, torch.linspace(3.0, 0.1, 40), 5, 2)
    values, vectors = _leading_eigh(covariances, 4)
    for at in range(5):
        alone = _leading_eigh(covariances[at : at + 1], 4)
        assert torch.equal(alone[0][0], values[at]) and torch.equal(alone[1][0], vectors[at])


def test_a_rank_half_the_features_or_more_is_solved_in_full():
    """Where twice the rank reaches D, the full solve's leading pairs, exactly."""
    covariances = _covariances(8, torch.linspace(4.0, 0.5, 8), 3, 3)
    values, vectors = _leading_eigh(covariances, 4)
    full_values, full_vectors = _eigh(covariances)
    assert torch.equal(values, full_values[:, 4:]) and torch.equal(vectors, full_vectors[..., 4:])
