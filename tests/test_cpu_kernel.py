"""Compiled CPU tiles of dense attention (attention/cpu_kernel.py): compiled in the background
while calls run uncompiled, then the same attention as the tiles run one operation at a time,
near pairs recomputed as there, used only where they pay, and a failed compilation that falls
back with a warning instead of failing a call."""

import warnings
from collections import Counter

import pytest
import torch

from rewa.attention import cpu_kernel, dense, dense_attention
from tests.support import FUSED, build_geometry

COMPILED = [
    (name, options)
    for name, options in FUSED
    if name in ("sphere", "poincare", "product") or (name == "kappa" and options["kappa"] != 0.0)
]
CHUNKS = {"q_chunk": 32, "k_chunk": 64}


@pytest.fixture
def compile_small_calls(monkeypatch):
    """Compile the tiles of calls of any size (the default waits for `MIN_LOGITS`), starting
    from a process in which no compilation has failed."""
    monkeypatch.setattr(cpu_kernel, "MIN_LOGITS", 1)
    monkeypatch.setattr(cpu_kernel, "enabled", True)
    monkeypatch.setattr(cpu_kernel, "_failure", None)
    monkeypatch.setattr(cpu_kernel, "_failure_reported", False)
    yield
    cpu_kernel.wait()


def kernels_for(stages, dtype):
    """The ready kernels of a product form, one per kind of call."""
    key = cpu_kernel.signature(stages, dtype)
    return [k for k in cpu_kernel._kernels if k[: len(key)] == key]


def inputs(dtype, nq=75, nk=150, d=8, dv=5, batch=(2, 3), seed=0):
    generator = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(*batch, n, d, generator=generator, dtype=dtype) for n in (nq, nk))
    v = torch.randn(*batch, nk, dv, generator=generator, dtype=dtype)
    return q, k, v


def attention_both_ways(g, q, k, v, monkeypatch, **options):
    """`(compiled, uncompiled)` results of one call: the first call starts the compilation
    and is answered uncompiled, the one after it is compiled (its kernels are seen to run)."""
    first = dense_attention(q, k, v, g, **CHUNKS, **options)
    assert cpu_kernel.wait(timeout=300)
    calls = []
    for key, kernel in cpu_kernel._kernels.items():
        counted = lambda *args, kernel=kernel: calls.append(1) or kernel(*args)  # noqa: E731
        monkeypatch.setitem(cpu_kernel._kernels, key, counted)
    compiled = dense_attention(q, k, v, g, **CHUNKS, **options)
    assert calls
    monkeypatch.setattr(cpu_kernel, "enabled", False)
    uncompiled = dense_attention(q, k, v, g, **CHUNKS, **options)
    monkeypatch.setattr(cpu_kernel, "enabled", True)
    for got, expected in zip(first, uncompiled, strict=True):  # partly compiled, if at all
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    return compiled, uncompiled


@pytest.mark.parametrize(("name", "options"), COMPILED, ids=[f"{n}-{o}" for n, o in COMPILED])
def test_compiled_tiles_give_the_attention_of_uncompiled_ones(
    name, options, compile_small_calls, monkeypatch
):
    g = build_geometry(name, 8, heads=3, **options).float()
    q, k, v = inputs(torch.float32)
    mask = torch.rand(2, 1, 75, 150, generator=torch.Generator().manual_seed(1)) > 0.2
    with torch.no_grad():
        stages = [term.stages for term in g.score_terms(g.witness(q), g.witness(k))]
        assert cpu_kernel.applies(g.witness(q), stages, q.shape[-2] * k.shape[-2])
        for call in ({}, {"causal": True}, {"mask": mask}):
            compiled, uncompiled = attention_both_ways(g, q, k, v, monkeypatch, **call)
            for got, expected in zip(compiled, uncompiled, strict=True):
                torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert kernels_for(stages, torch.float32)
    assert cpu_kernel._failure is None


def test_compiled_tiles_in_float64_and_their_gradients(compile_small_calls, monkeypatch):
    """float64 to float64's accuracy; gradients recomputed by the backward pass as without
    compilation."""
    g = build_geometry("product", 8, heads=3)
    q, k, v = inputs(torch.float64)

    def attention_and_gradients():
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = dense_attention(*leaves, g, causal=True, **CHUNKS)
        (out.square().sum() + lse.sin().sum()).backward()
        return [out.detach(), lse.detach()] + [t.grad for t in leaves]

    attention_and_gradients()
    assert cpu_kernel.wait(timeout=300)
    compiled = attention_and_gradients()
    assert kernels_for([("sqrt",), ("arcsin_of_root",), ("acosh1p",)], torch.float64)
    monkeypatch.setattr(cpu_kernel, "enabled", False)
    uncompiled = attention_and_gradients()
    for got, expected in zip(compiled, uncompiled, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


def test_near_pairs_are_recomputed_in_compiled_tiles(compile_small_calls, monkeypatch):
    """Self-attention over identical queries and keys: every diagonal pair is at distance 0,
    where the Gram expansion is all rounding error. The compiled tiles find those pairs from
    the row minima they compute and recompute them, as the uncompiled ones do; the float64
    attention is the reference. Pairs beyond the screen keep the Gram expansion's relative
    accuracy of about 1e-4 (`numerics.NEAR_TOLERANCE`), whose rounding depends on the order in
    which the CPU's matrix product sums (out within 1.5e-5 of the reference on an AVX2 CPU,
    1.3e-4 on one with AVX-512 and AMX); the diagonal pairs unrefined are off by far more."""
    g = build_geometry("product", 8, heads=3).float()
    q, _, v = inputs(torch.float32, nq=150)
    q = q * 3  # far from the origin, where the expansion's rounding error is large
    with torch.no_grad():
        compiled, uncompiled = attention_both_ways(g, q, q, v, monkeypatch)
        reference = dense_attention(q.double(), q.double(), v.double(), g.double(), **CHUNKS)
        g.float()
        monkeypatch.setattr(dense, "near_pairs", lambda *args: None)
        unrefined = dense_attention(q, q, v, g, **CHUNKS)  # compiled, as the tiles are ready
    for got, expected in zip(compiled, uncompiled, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    for got, expected in zip(compiled, reference, strict=True):
        torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=1e-3)
    for got, expected in zip(unrefined, reference, strict=True):  # what is recomputed
        assert (got.double() - expected).abs().max() > 0.1


def test_a_failed_compilation_warns_once_and_every_call_is_answered(
    compile_small_calls, monkeypatch
):
    def failing_compile(function, **options):
        def compiled(*args):
            raise RuntimeError("no C++ compiler")

        return compiled

    monkeypatch.setattr(cpu_kernel, "_kernels", {})
    monkeypatch.setattr(cpu_kernel.torch, "compile", failing_compile)
    g = build_geometry("product", 8, heads=3).float()
    q, k, v = inputs(torch.float32)
    with torch.no_grad():
        with pytest.warns(RuntimeWarning, match="no C.. compiler") as caught:
            first = dense_attention(q, k, v, g, **CHUNKS)  # answered as the compilation fails
            cpu_kernel.wait()
        assert len(caught) == 1
        assert not cpu_kernel.applies(g.witness(q), [("acosh1p",)], cpu_kernel.MIN_LOGITS)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            again = dense_attention(q, k, v, g, **CHUNKS)
        monkeypatch.setattr(cpu_kernel, "enabled", False)
        expected = dense_attention(q, k, v, g, **CHUNKS)
    assert not cpu_kernel._kernels
    for got in (first, again):
        for value, reference in zip(got, expected, strict=True):
            torch.testing.assert_close(value, reference, rtol=0, atol=0)


def test_compilation_applies_where_it_pays(monkeypatch):
    monkeypatch.setattr(cpu_kernel, "enabled", True)
    monkeypatch.setattr(cpu_kernel, "_failure", None)
    w = torch.zeros(4, 8)
    product = [("sqrt",), ("arcsin_of_root",), ("acosh1p",)]
    assert cpu_kernel.applies(w, product, cpu_kernel.MIN_LOGITS)
    assert not cpu_kernel.applies(w, product, cpu_kernel.MIN_LOGITS - 1)  # too small to pay
    assert not cpu_kernel.applies(w, [("sqrt",)], cpu_kernel.MIN_LOGITS)  # a single sqrt
    assert cpu_kernel.applies(w, [("acosh1p", "square")], cpu_kernel.MIN_LOGITS)
    assert not cpu_kernel.applies(w, None, cpu_kernel.MIN_LOGITS)  # no product form
    assert not cpu_kernel.applies(w.half(), product, cpu_kernel.MIN_LOGITS)
    assert not cpu_kernel.applies(w.to("meta"), product, cpu_kernel.MIN_LOGITS)


@pytest.mark.parametrize(
    ("call", "expected"),
    [
        ({}, {"combine_softmax_step": 4}),
        ({"causal": True}, {"combine_softmax_step": 2, "combine": 2, "softmax_step": 2}),
    ],
)
def test_tiles_no_mask_touches_run_one_kernel_each(
    call, expected, compile_small_calls, monkeypatch
):
    """2 x 2 tiles: a tile that no mask touches runs its logits and its online-softmax step as
    one compiled kernel, and only that kernel is compiled for an unmasked call; the causal
    call's two tiles that reach past a query's position run the logits' kernel, the mask and
    the step's kernel. Both answer as the uncompiled tiles do. (d = 32: no pair is near enough
    to be recomputed, which would run a tile's kernel again.)"""
    monkeypatch.setattr(cpu_kernel, "_kernels", {})
    g = build_geometry("product", 32, heads=3).float()
    q, k, v = inputs(torch.float32, nq=64, nk=128, d=32)
    with torch.no_grad():
        dense_attention(q, k, v, g, **CHUNKS, **call)
        assert cpu_kernel.wait(timeout=300)
        if not call:
            assert {key[0] for key in cpu_kernel._kernels} == {"combine_softmax_step"}
        calls = Counter()
        for key, kernel in list(cpu_kernel._kernels.items()):
            counted = lambda *args, key=key, kernel=kernel: calls.update([key[0]]) or kernel(*args)  # noqa: E731
            monkeypatch.setitem(cpu_kernel._kernels, key, counted)
        compiled = dense_attention(q, k, v, g, **CHUNKS, **call)
        monkeypatch.setattr(cpu_kernel, "enabled", False)
        uncompiled = dense_attention(q, k, v, g, **CHUNKS, **call)
    assert calls == expected
    for got, want in zip(compiled, uncompiled, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
