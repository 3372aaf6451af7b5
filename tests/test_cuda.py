"""The CUDA paths on a GPU: the fused kernel (attention/cuda_kernel.py), the tiled fallback,
gradients, sparse and tail attention, each against the same computation on the CPU.

These tests need a CUDA device; on machines without one they are skipped, and the CUDA dispatch
is covered by the CPU-side tests of tests/test_fused_attention.py and tests/test_tail.py."""

import copy

import pytest
import torch

from rewa.attention import cuda_kernel, dense_attention
from rewa.index import (
    ClusterHeads,
    KeyClusters,
    build_index,
    retrieval_attention,
    tail_attention_heads_with_reads,
    tail_attention_with_reads,
)
from rewa.index.tail import decode as decode_module
from rewa.index.tail import fixed_step as fixed_module
from tests.support import FUSED, build_geometry, ivf_list_attention
from tests.test_tail_decode import _queries, _stack

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CUDA = torch.device("cuda")
GEOMETRIES = [*FUSED, ("cone", {}), ("adaptive_product", {})]
IDS = [f"{name}-{options}" for name, options in GEOMETRIES]
F32 = {"rtol": 2e-5, "atol": 2e-5}


def inputs(nq, nk, d=8, dv=5, batch=(2, 3), dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(*batch, n, d, generator=generator, dtype=dtype) for n in (nq, nk))
    return q, k, torch.randn(*batch, nk, dv, generator=generator, dtype=dtype)


def test_the_kernel_is_available():
    assert cuda_kernel.available()


@pytest.mark.parametrize(("name", "options"), GEOMETRIES, ids=IDS)
@pytest.mark.parametrize(("nq", "nk"), [(67, 150), (130, 130), (1, 300), (200, 40)])
@pytest.mark.parametrize("causal", [False, True])
def test_dense_attention_on_cuda_is_as_accurate_as_on_the_cpu(name, options, nq, nk, causal):
    """Float32 on both devices against float64: the Gram expansions of float32 distances
    cancel for near points (components of 2 dimensions here), so both differ from float64 by
    more than rounding, and the CUDA result must be no further from it than the CPU's."""
    g = build_geometry(name, 8, heads=3, **options)
    q, k, v = inputs(nq, nk, dtype=torch.float64)
    with torch.no_grad():
        exact = dense_attention(q, k, v, g, causal=causal)
        g32 = g.float()
        cpu = dense_attention(q.float(), k.float(), v.float(), g32, causal=causal)
        g_cuda = g32.to(CUDA)
        cuda = dense_attention(*(t.float().to(CUDA) for t in (q, k, v)), g_cuda, causal=causal)
    for i in range(2):
        finite = torch.isfinite(exact[i])
        assert torch.equal(torch.isfinite(cuda[i].cpu()), finite)
        cpu_error = (cpu[i].double() - exact[i])[finite].abs().max()
        cuda_error = (cuda[i].cpu().double() - exact[i])[finite].abs().max()
        assert cuda_error <= 2 * cpu_error + 1e-5


@pytest.mark.parametrize("name", ["euclidean", "sphere", "poincare", "product"])
def test_the_kernel_and_the_tiled_path_agree_on_cuda(name, monkeypatch):
    g = build_geometry(name, 64, heads=2).float().to(CUDA)
    q, k, v = (t.to(CUDA) for t in inputs(1000, 3000, d=64, dv=64, batch=(2,)))
    with torch.no_grad():
        fused = dense_attention(q, k, v, g, causal=True)
        monkeypatch.setattr(cuda_kernel, "applies", lambda *args: False)
        tiled = dense_attention(q, k, v, g, causal=True, q_chunk=256, k_chunk=512)
    torch.testing.assert_close(fused[0], tiled[0], **F32)
    torch.testing.assert_close(fused[1], tiled[1], **F32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs_accumulate_in_float32(dtype):
    """Half-precision inputs are computed in float32: the output in the inputs' dtype, lse in
    float32, no further from the float64 attention of the same (rounded) inputs than the CPU's
    float32 is, as in the float32 accuracy test above."""
    g = build_geometry("poincare", 64, heads=2).double()
    q, k, v = (t.to(dtype) for t in inputs(300, 500, d=64, dv=64, batch=(2,)))
    with torch.no_grad():
        exact, exact_lse = dense_attention(*(t.double() for t in (q, k, v)), g)
        g32 = g.float()
        _, cpu_lse = dense_attention(*(t.float() for t in (q, k, v)), g32)
        out, lse = dense_attention(*(t.to(CUDA) for t in (q, k, v)), g32.to(CUDA))
    assert out.dtype == dtype and lse.dtype == torch.float32
    torch.testing.assert_close(out.double().cpu(), exact, rtol=1e-2, atol=1e-2)
    cpu_error = (cpu_lse.double() - exact_lse).abs().max()
    assert (lse.cpu().double() - exact_lse).abs().max() <= 2 * cpu_error + 1e-5


@pytest.mark.parametrize("name", ["dot", "sphere", "poincare", "kappa", "product"])
def test_gradients_on_cuda_are_as_accurate_as_on_the_cpu(name):
    """Float32 gradients on both devices against float64 ones (the backward pass recomputes
    tiles with PyTorch's operations on either device; see the forward test for why float32
    differs from float64 by more than rounding here). The bound's floor is relative: a
    parameter's gradient sums every pair's term (magnitudes of tens), where float32's own
    spacing is above 1e-6."""
    g64 = build_geometry(name, 8, heads=3)
    q, k, v = inputs(40, 70, dtype=torch.float64)

    def gradients(geometry, dtype, device):
        leaves = [t.detach().to(device, dtype).requires_grad_() for t in (q, k, v)]
        out, lse = dense_attention(*leaves, geometry, causal=True)
        (out.square().sum() + lse.sum()).backward()
        params = [p.grad.cpu().double() for p in geometry.parameters() if p.grad is not None]
        return [t.grad.cpu().double() for t in leaves] + params

    exact = gradients(g64, torch.float64, "cpu")
    cpu = gradients(copy.deepcopy(g64).float(), torch.float32, "cpu")
    cuda = gradients(copy.deepcopy(g64).float().to(CUDA), torch.float32, CUDA)
    assert len(cuda) == len(cpu) == len(exact) >= 3
    for on_cuda, on_cpu, reference in zip(cuda, cpu, exact, strict=True):
        cpu_error = (on_cpu - reference).abs().max()
        floor = 1e-5 * max(1.0, reference.abs().max().item())
        assert (on_cuda - reference).abs().max() <= 2 * cpu_error + floor


def _clusters_on_both_devices(name: str):
    """`((k, v), q, clusters, on_cuda)`: 3000 random keys of d = 16 clustered on the CPU (12
    centres) and the same clusters loaded on the GPU, and 100 queries."""
    g_cpu = build_geometry(name, 16).float()
    generator = torch.Generator().manual_seed(3)
    k = torch.randn(3000, 16, generator=generator)
    v = torch.randn(3000, 8, generator=generator)
    q = torch.randn(100, 16, generator=generator)
    with torch.no_grad():
        clusters = KeyClusters.build(g_cpu.witness(k), v, g_cpu, n_clusters=12)
    on_cuda = KeyClusters.from_bytes(
        clusters.to_bytes(), copy.deepcopy(g_cpu).to(CUDA), device=CUDA
    )
    return (k, v), q, clusters, on_cuda


@pytest.mark.parametrize("name", ["dot", "poincare", "product"])
def test_tail_attention_on_cuda_equals_the_cpu(name):
    """The same clusters (built on the CPU, loaded on the GPU): the same keys read, the same
    estimate up to the value shift's bfloat16 product on CUDA (index/tail.py `shift_dtype`)."""
    _, q, clusters, on_cuda = _clusters_on_both_devices(name)
    with torch.no_grad():
        expected, expected_lse, cpu_read = tail_attention_with_reads(q, clusters, budget=0.2)
        out, lse, cuda_read = tail_attention_with_reads(q.to(CUDA), on_cuda, budget=0.2)
    assert torch.equal(cuda_read.cpu(), cpu_read)
    difference = (out.cpu() - expected).norm(dim=-1) / expected.norm(dim=-1)
    assert difference.max() < 1e-2
    torch.testing.assert_close(lse.cpu(), expected_lse, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("name", ["dot", "poincare"])
def test_a_measured_tail_call_on_cuda_answers_its_measured_queries_exactly(name):
    """`measured_queries` on the GPU (index/tail/measured.py): the measured rows are dense
    attention (the fused kernel for the dot product), the rest near the CPU's answers."""
    (k, v), q, clusters, on_cuda = _clusters_on_both_devices(name)
    g_cuda = on_cuda.geometry
    options = {"budget": 0.05, "measured_queries": 8}
    with torch.no_grad():
        expected, _, cpu_read = tail_attention_with_reads(q, clusters, **options)
        out, lse, cuda_read = tail_attention_with_reads(q.to(CUDA), on_cuda, **options)
        exact, exact_lse = dense_attention(q.to(CUDA), k.to(CUDA), v.to(CUDA), g_cuda)
    assert torch.equal(cuda_read.cpu(), cpu_read)
    rows = (cuda_read == 3000).nonzero().squeeze(-1)
    assert len(rows) == 8
    torch.testing.assert_close(out[rows], exact[rows], **F32)
    torch.testing.assert_close(lse[rows], exact_lse[rows], **F32)
    difference = (out.cpu() - expected).norm(dim=-1) / expected.norm(dim=-1)
    assert difference.max() < 1e-2


@pytest.mark.parametrize("index", ["flat", "lsh"])
def test_retrieval_attention_on_cuda_equals_the_cpu(index):
    """The index is built by the same (CPU) FAISS or LSH code on both devices; the candidate
    sets, and so the attention, are the same."""
    g = build_geometry("dot", 16).float()
    generator = torch.Generator().manual_seed(4)
    k = torch.randn(2000, 16, generator=generator)
    v = torch.randn(2000, 8, generator=generator)
    q = torch.randn(50, 16, generator=generator)
    with torch.no_grad():
        expected = retrieval_attention(q, k, v, g, top_k=32, index=index)
        g_cuda = g.to(CUDA)
        out, lse = retrieval_attention(
            q.to(CUDA), k.to(CUDA), v.to(CUDA), g_cuda, top_k=32, index=index
        )
    assert out.device.type == "cuda"
    torch.testing.assert_close(out.cpu(), expected[0], **F32)
    torch.testing.assert_close(lse.cpu(), expected[1], **F32)


def test_tail_clusters_built_on_cuda_are_the_cpus():
    """k-means (index/kmeans.py, FAISS's draws) and the nearest centres on the GPU: the same
    pieces, keys in the same order, as a build on the CPU (blobs far apart: no ties)."""
    from benchmarks.data import clustered

    data = clustered(16384)
    g = data.geometry()
    with torch.no_grad():
        on_cpu = KeyClusters.build(g.witness(data.k), data.v, g)
        on_cuda = KeyClusters.build(
            g.to(CUDA).witness(data.k.to(CUDA)), data.v.to(CUDA), g.to(CUDA)
        )
    assert on_cuda.order.device.type == "cuda"
    assert torch.equal(on_cuda.order.cpu(), on_cpu.order)
    assert torch.equal(on_cuda.offsets.cpu(), on_cpu.offsets)
    torch.testing.assert_close(on_cuda.centroids.cpu(), on_cpu.centroids, **F32)


@pytest.mark.parametrize("name", ["dot", "poincare"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("top_k", [None, 32])
def test_ivf_lists_trained_on_cuda_attend_as_on_the_cpu(name, causal, top_k):
    """IVF lists trained and assigned on the GPU (index/kmeans.py, unless FAISS has GPU
    support) and read in padded blocks (`_padded_list_attention`): with every list probed,
    both devices attend to every key (top_k None) or the exact top K."""
    g = build_geometry(name, 16).float()
    generator = torch.Generator().manual_seed(5)
    k = torch.randn(3000, 16, generator=generator) * 0.3
    v = torch.randn(3000, 8, generator=generator)
    options = {"nlist": 12, "nprobe": 12, "probe_mass": 0.0}

    def attention(k, v, g, index):
        if top_k is None:  # the lists read (retrieval_attention would answer densely)
            positions = torch.arange(len(k), device=k.device) if causal else None
            return ivf_list_attention(k, v, g, index, positions=positions)
        return retrieval_attention(k, k, v, g, top_k=top_k, index=index, causal=causal)

    with torch.no_grad():
        expected = attention(k, v, g, build_index(k, g, "ivf", **options))
        g_cuda = g.to(CUDA)
        k_cuda, v_cuda = k.to(CUDA), v.to(CUDA)
        index = build_index(k_cuda, g_cuda, "ivf", **options)
        out, lse = attention(k_cuda, v_cuda, g_cuda, index)
    assert sum(len(ids) for ids in index.parts[0].lists(CUDA)) == 3000
    torch.testing.assert_close(out.cpu(), expected[0], **F32)
    torch.testing.assert_close(lse.cpu(), expected[1], **F32)


def test_ivf_lists_trained_on_cuda_find_the_neighbours():
    """At the default settings the GPU-trained lists read as many of each query's true
    top 64 as the CPU's FAISS-trained ones."""
    from benchmarks.data import clustered
    from rewa.index import exact_topk, topk_recall
    from rewa.index.ivf_blocks import probed_keys

    data = clustered(32768)
    g = data.geometry()
    recalls = []
    for device in ("cpu", CUDA):
        gd = g.to(device)
        k, q = data.k.to(device), data.q[:512].to(device)
        with torch.no_grad():
            index = build_index(k, gd, "ivf")
            qw = gd.witness(q)
            exact = exact_topk(qw, gd.witness(k), gd, 64)
            recalls.append(topk_recall(probed_keys(index, qw), exact).float().mean().item())
    assert recalls[1] >= recalls[0] - 0.02


def _decode_heads_on_cuda():
    """The compiled step's test clusters (3 heads of different cluster counts, outlier clusters)
    loaded on the GPU with one geometry, and their centres."""
    heads, centres = _stack(torch.float32)
    geometry = copy.deepcopy(heads.geometry).to(CUDA)
    on_cuda = [
        KeyClusters.from_bytes(clusters.to_bytes(), geometry, device=CUDA)
        for clusters in heads.heads
    ]
    return ClusterHeads.stacked(on_cuda), centres


@pytest.mark.parametrize(
    ("budget", "always"),
    [
        (0.002, None),
        (0.01, None),
        (0.05, None),
        (0.05, "sinks-and-window"),
        (0.3, "sinks-and-window"),
    ],
)
def test_a_decode_step_on_cuda_replays_one_graph_with_the_batched_answers(
    monkeypatch, budget, always
):
    """`tail_attention_heads` with a decode step's 4 queries per head on CUDA: the fixed-shape
    step, captured as a CUDA graph at the first call and replayed with the next queries, answers
    as its operations launched one by one, and as the batched stages up to the value shift's
    bfloat16 rounding."""
    heads, centres = _decode_heads_on_cuda()
    n_keys = heads.heads[0].n_keys
    if always is not None:  # sinks and a window, as a service request may ask for them
        always = torch.cat([torch.arange(4), torch.arange(n_keys - 64, n_keys)]).to(CUDA)
    captured = []
    capture = fixed_module._captured
    monkeypatch.setattr(fixed_module, "_captured", lambda *a: captured.append(1) or capture(*a))
    with torch.no_grad():
        for seed in range(3):
            q = _queries(centres, 4, seed=seed).to(CUDA)
            options = {"budget": budget, "always": always}
            graphed = tail_attention_heads_with_reads(q, heads, **options)
            with monkeypatch.context() as patch:
                patch.setattr(fixed_module, "USE_GRAPHS", False)
                eager = tail_attention_heads_with_reads(q, heads, **options)
                patch.setattr(fixed_module, "FIXED_STEP_ROWS", 0)
                patch.setattr(decode_module, "COMPILED_STEP_ROWS", 0)
                batched = tail_attention_heads_with_reads(q, heads, **options)
            torch.testing.assert_close(graphed.out, eager.out, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(graphed.lse, eager.lse, rtol=1e-6, atol=1e-6)
            assert torch.equal(graphed.keys_read, batched.keys_read)
            torch.testing.assert_close(graphed.lse, batched.lse, rtol=1e-4, atol=1e-4)
            difference = (graphed.out - batched.out).norm(dim=-1) / batched.out.norm(dim=-1)
            assert difference.max() < 1e-2
    assert len(captured) == 1  # one capture, then replays
    graphs = heads.derived[f"{fixed_module.__name__}.graphs"]
    assert all(graph is not None for graph in graphs.values())  # the capture succeeded


def test_a_decode_step_on_cuda_keeps_its_answers_after_the_next_replay():
    """The graph writes its outputs in place at each replay: an answer is a copy."""
    heads, centres = _decode_heads_on_cuda()
    with torch.no_grad():
        first = tail_attention_heads_with_reads(_queries(centres, 2, seed=5).to(CUDA), heads)
        kept = first.out.clone()
        tail_attention_heads_with_reads(_queries(centres, 2, seed=6).to(CUDA), heads)
    assert torch.equal(first.out, kept)
