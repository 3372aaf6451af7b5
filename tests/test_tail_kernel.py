"""The compiled exact part of tail attention (`rewa.index.tail.kernel`): the same sums as the
per-cluster matrix products, for several heads, with keys read elsewhere left out, exact where
the logits' range overflows any fixed reference, in float32 and float64; and which calls take
it."""

import threading
import time

import pytest
import torch
from threadpoolctl import threadpool_info, threadpool_limits

from rewa.attention import make_geometry
from rewa.index import ClusterHeads, KeyClusters, tail_attention, tail_attention_heads
from rewa.index.tail import exact as exact_module
from rewa.index.tail import kernel
from rewa.index.tail.exact import _cluster_product_sums
from rewa.index.tail.threads import background_threads, cpu_workers, one_blas_thread, spread

HEADS, N_KEYS, DIM, VALUE_DIM, QUERIES = 3, 2000, 16, 6, 5


def _clusters(dtype):
    generator = torch.Generator().manual_seed(0)
    geometry = make_geometry("dot", DIM).to(dtype)
    keys = torch.randn(HEADS, N_KEYS, DIM, generator=generator, dtype=dtype)
    values = torch.randn(HEADS, N_KEYS, VALUE_DIM, generator=generator, dtype=dtype)
    with torch.no_grad():
        clusters = [
            KeyClusters.build(keys[h], values[h], geometry, max_cluster_keys=60 + 20 * h)
            for h in range(HEADS)
        ]
    queries = torch.randn(HEADS * QUERIES, DIM, generator=generator, dtype=dtype)
    return geometry, keys, values, clusters, queries


def _pairs(clusters, seed=1):
    """Random `(row, cluster)` pairs, rows `head * QUERIES + query` ascending, each row's
    clusters distinct; query 0 of every head visits none."""
    generator = torch.Generator().manual_seed(seed)
    rows, columns = [], []
    for head, head_clusters in enumerate(clusters):
        for query in range(1, QUERIES):
            chosen = torch.randperm(head_clusters.n_clusters, generator=generator)[:4]
            rows.append(torch.full((len(chosen),), head * QUERIES + query))
            columns.append(chosen.sort().values)
    return torch.cat(rows), torch.cat(columns)


def _reference_sums(queries, keys, values, clusters, pair_query, pair_cluster, is_always):
    """Per row: the log-sum-exp and softmax-weighted value over its visited keys, in float64,
    from the keys in their original order."""
    lse = torch.full((len(queries),), float("-inf"), dtype=torch.float64)
    out = torch.zeros(len(queries), VALUE_DIM, dtype=torch.float64)
    for row in pair_query.unique().tolist():
        head = row // QUERIES
        head_clusters = clusters[head]
        ids = []
        for cluster in pair_cluster[pair_query == row].tolist():
            begin, end = head_clusters.offsets[cluster], head_clusters.offsets[cluster + 1]
            positions = torch.arange(int(begin), int(end))
            if is_always[head] is not None:
                positions = positions[~is_always[head][positions]]
            ids.append(head_clusters.order[positions])
        ids = torch.cat(ids)
        logits = (queries[row].double() @ keys[head, ids].double().T) * DIM**-0.5
        lse[row] = logits.logsumexp(0)
        out[row] = logits.softmax(0) @ values[head, ids].double()
    return out, lse


@pytest.mark.parametrize("dtype,tolerance", [(torch.float64, 1e-10), (torch.float32, 2e-5)])
@pytest.mark.parametrize("flagged", [False, True])
def test_compiled_sums_equal_the_exact_attention_over_the_visited_keys(dtype, tolerance, flagged):
    geometry, keys, values, clusters, queries = _clusters(dtype)
    pair_query, pair_cluster = _pairs(clusters)
    is_always = [None] * HEADS
    if flagged:  # every third sorted position of heads 0 and 2 is read elsewhere
        for head in (0, 2):
            is_always[head] = torch.arange(N_KEYS) % 3 == 0
    scaled = queries * geometry.scale
    with torch.no_grad():
        sums, weight, peak = kernel.dot_product_sums(
            scaled, clusters, pair_query, pair_cluster, is_always
        )
    out, lse = _reference_sums(queries, keys, values, clusters, pair_query, pair_cluster, is_always)
    visited = torch.isfinite(lse)
    assert not visited[::QUERIES].any() and visited.sum() == HEADS * (QUERIES - 1)
    # Rows that visit nothing: no sum, no peak.
    assert (weight[~visited] == 0).all() and torch.isneginf(peak[~visited]).all()
    found_lse = (peak + weight.log())[visited].double()
    found_out = (sums / weight.unsqueeze(-1))[visited].double()
    torch.testing.assert_close(found_lse, lse[visited], rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(found_out, out[visited], rtol=tolerance, atol=tolerance)
    # The per-cluster products give the same, from a reference near the largest logit.
    with torch.no_grad():
        products, totals = _cluster_product_sums(
            queries, clusters, pair_query, pair_cluster, is_always, peak.nan_to_num(neginf=0.0)
        )
    torch.testing.assert_close(totals, weight, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(products, sums, rtol=tolerance, atol=tolerance)


def test_logits_far_beyond_the_float_range_of_any_fixed_reference_stay_exact():
    # Logits of +-10^4 in float32: exp of their differences overflows for any single reference
    # taken before reading them; the running peak keeps every exponential at most 1.
    geometry, keys, values, clusters, queries = _clusters(torch.float32)
    pair_query, pair_cluster = _pairs(clusters, seed=3)
    queries = queries * 2000.0
    with torch.no_grad():
        sums, weight, peak = kernel.dot_product_sums(
            queries * geometry.scale, clusters, pair_query, pair_cluster, [None] * HEADS
        )
    out, lse = _reference_sums(
        queries, keys, values, clusters, pair_query, pair_cluster, [None] * HEADS
    )
    visited = torch.isfinite(lse)
    assert lse[visited].abs().max() > 1000
    assert torch.isfinite(weight).all() and (weight[visited] >= 1).all()
    torch.testing.assert_close(
        (peak + weight.log())[visited].double(), lse[visited], rtol=1e-5, atol=0
    )
    torch.testing.assert_close(
        (sums / weight.unsqueeze(-1))[visited].double(), out[visited], rtol=1e-4, atol=1e-4
    )


def test_few_visitors_picks_the_compiled_loop_for_decode_steps_only():
    clusters = _clusters(torch.float64)[3]
    n_clusters = sum(c.n_clusters for c in clusters)
    few = torch.zeros(n_clusters * kernel.MAX_VISITORS, dtype=torch.long)
    assert kernel.few_visitors(torch.zeros(3, dtype=torch.long), clusters)
    assert kernel.few_visitors(few, clusters)
    assert not kernel.few_visitors(torch.cat([few, few[:1]]), clusters)


@pytest.mark.parametrize("threads", [1, 2])
def test_tail_attention_gives_the_same_answers_through_either_loop(monkeypatch, threads):
    """Many queries per head (the products' case) and forced through the compiled loop; with
    one and two threads (the heads spread over the workers)."""
    clusters = _clusters(torch.float64)[3]
    generator = torch.Generator().manual_seed(5)
    queries = torch.randn(HEADS, 300, DIM, generator=generator, dtype=torch.float64)
    heads = ClusterHeads.stacked(clusters)
    calls = []
    compiled = kernel.dot_product_sums

    def counted(*args):
        calls.append(len(args[0]))
        return compiled(*args)

    monkeypatch.setattr(exact_module, "dot_product_sums", counted)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad():
            by_products = tail_attention_heads(queries, heads, budget=0.1)
            assert not calls
            monkeypatch.setattr(kernel, "MAX_VISITORS", 10**9)
            compiled_answer = tail_attention_heads(queries, heads, budget=0.1)
            one_head = tail_attention(queries[1, :4], clusters[1], budget=0.1)
    finally:
        torch.set_num_threads(previous)
    assert calls  # the compiled loop ran (over every head's rows, twice where outliers are apart)
    for found, expected in zip(compiled_answer, by_products, strict=True):
        torch.testing.assert_close(found, expected, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(one_head[0], by_products[0][1, :4], rtol=1e-10, atol=1e-10)


def test_compile_ahead_fills_numbas_cache_with_every_loop(tmp_path):
    """What the image runs when it is built: the compiled loops (the exact part's, the value
    shift's, the estimate's, the decode step's, the IVF shortlist's and the LSH attention's)
    end up in Numba's cache, so a server's first decode step compiles nothing. For float32 only
    (float64 is the same call with the other dtype, and compiling both into an empty cache
    took 44 s of the suite)."""
    import os
    import subprocess
    import sys

    environment = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    subprocess.run(
        [sys.executable, "-c",
         "import numpy\nfrom rewa.index import largest\n"
         "from rewa.index.tail.decode import compile_ahead\n"
         "compile_ahead((numpy.float32,))\nlargest.compile_ahead((numpy.float32,))\n"
         "from rewa.index import lsh_attention\nlsh_attention.compile_ahead((numpy.float32,))"],
        check=True, env=environment, timeout=300,
    )  # fmt: skip
    cached = sorted(path.name for path in tmp_path.rglob("*.nbc"))
    loops = ("kernel._head_sums", "kernel._head_shift", "kernel._estimate_rows")
    for loop in (*loops, "decode._decode_head", "largest._row_largest", "_bucket_walk"):
        assert [name for name in cached if f"{loop}-" in name], cached
    # A decode step afterwards (float32, window and sinks read apart) adds no compiled version.
    step = (
        "import torch\n"
        "from rewa.index import LocalMemory\n"
        "memory = LocalMemory(2, 16, open_segment=0)\n"
        "memory.append(torch.randn(2, 3000, 16), torch.randn(2, 3000, 16))\n"
        "memory.attend(torch.randn(2, 4, 16))\n"
    )
    subprocess.run([sys.executable, "-c", step], check=True, env=environment, timeout=300)
    assert sorted(path.name for path in tmp_path.rglob("*.nbc")) == cached


def _spread(n_items: int, failing: int | None = None):
    """The items `spread` ran, the threads it ran them on, and the error it raised."""
    done, callers = [], set()

    def work(item):
        if item == failing:
            raise RuntimeError(f"item {item} failed")
        done.append(item)
        callers.add(threading.get_ident())

    try:
        spread(work, range(n_items))
    except RuntimeError as error:
        return done, callers, error
    return done, callers, None


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_spread_runs_every_item_once_and_raises_an_items_error(threads):
    """`threads.spread` runs each item once however many threads take them (more threads than
    items too), and raises an error of any item (on the calling thread or a worker) once every
    thread has stopped: the thread whose item raised takes no more, the others run every item
    left (on one thread, nothing after the failing item runs)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for n_items in (0, 1, 2, 5):
            done, callers, error = _spread(n_items)
            assert sorted(done) == list(range(n_items)) and error is None
            assert len(callers) <= min(threads, n_items)
        for failing in (0, 4):
            done, _, error = _spread(5, failing)
            assert str(error) == f"item {failing} failed"
            left = [item for item in range(5) if item != failing]
            assert sorted(done) == (left if threads > 1 else list(range(failing)))
    finally:
        torch.set_num_threads(previous)


def test_spread_gives_the_next_item_to_the_thread_that_is_free():
    """While one thread runs a slow item (a sleep releases the GIL, as a compiled loop does),
    the other takes every other item."""
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    ran = {}

    def work(item):
        if item == 0:
            time.sleep(0.3)
        ran[item] = threading.get_ident()

    try:
        spread(work, range(10))
    finally:
        torch.set_num_threads(previous)
    assert sorted(ran) == list(range(10))
    assert ran[0] not in {ran[item] for item in range(1, 10)}


def test_background_threads_run_pytorch_on_one_thread_each():
    """The threads of `background_threads` pools (tail's workers, `LocalMemory`'s build
    thread) run PyTorch's CPU operations on one thread each, and the caller's setting stays as
    it was (PyTorch's thread count is a setting per thread)."""
    from rewa.index import memory as index_memory

    before = torch.get_num_threads()
    pool = background_threads(2, "rewa-test")
    try:
        for threads in (pool, cpu_workers(), index_memory._builder()):
            assert threads.submit(torch.get_num_threads).result() == 1
    finally:
        pool.shutdown()
    assert torch.get_num_threads() == before


def _blas_thread_counts() -> set[int]:
    """The thread counts of numpy's own BLAS (other libraries, FAISS's, may load one too)."""
    found = {
        info["num_threads"]
        for info in threadpool_info()
        if info["user_api"] == "blas" and "numpy" in info["filepath"]
    }
    assert found  # numpy's BLAS is loaded
    return found


def test_numpys_blas_runs_on_one_thread_within_one_blas_thread():
    with threadpool_limits(limits=2, user_api="blas"):  # more than one, on any machine
        assert _blas_thread_counts() == {2}
        with one_blas_thread():
            assert _blas_thread_counts() == {1}
        assert _blas_thread_counts() == {2}


def test_the_exact_parts_numpy_products_run_on_one_blas_thread(monkeypatch):
    """Many queries per cluster: the exact part's products per cluster in numpy, every one of
    them with numpy's BLAS on one thread (its spinning threads slowed PyTorch's next
    operations), whatever the process set."""
    threads_seen = []
    matmul = exact_module.np.matmul

    def watched(*arguments, **options):
        threads_seen.append(_blas_thread_counts())
        return matmul(*arguments, **options)

    geometry = make_geometry("dot", 8).double()
    generator = torch.Generator().manual_seed(0)
    keys = torch.randn(3000, 8, generator=generator, dtype=torch.float64)
    values = torch.randn(3000, 4, generator=generator, dtype=torch.float64)
    clusters = KeyClusters.build(keys, values, geometry)
    queries = torch.randn(400, 8, generator=generator, dtype=torch.float64)
    monkeypatch.setattr(exact_module.np, "matmul", watched)
    with torch.no_grad(), threadpool_limits(limits=2, user_api="blas"):
        tail_attention(queries, clusters, budget=0.05)
    assert threads_seen and all(seen == {1} for seen in threads_seen)
