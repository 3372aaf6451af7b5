"""Shared test support: the tolerance table and geometry builders."""

import torch

from rewa.attention import make_geometry

# One tolerance table for every comparison against an independent implementation (geoopt or the
# float64 references of tests/reference.py), per dtype.
TOLERANCES = {
    torch.float32: {"rtol": 1e-5, "atol": 1e-5},
    torch.float64: {"rtol": 1e-10, "atol": 1e-12},
}

GEOMETRY_NAMES = ["dot", "euclidean", "sphere", "poincare", "kappa", "product", "adaptive_product"]


def build_geometry(name: str, dim: int, heads: int = 1, **options) -> torch.nn.Module:
    """A float64 geometry with non-trivial parameters (curvature away from its default 0)."""
    if name == "kappa" and "kappa" not in options:
        options["kappa"] = [-0.7, 0.4, -1e-9][:heads] if heads > 1 else -0.7
    torch.manual_seed(1234)
    return make_geometry(name, dim, heads, **options).double()


# (name, options) of every geometry whose dense logits have a product form (`score_terms`).
FUSED = [
    ("dot", {}),
    ("euclidean", {}),
    ("euclidean", {"power": 2}),
    ("sphere", {}),
    ("sphere", {"power": 2}),
    ("poincare", {}),
    ("poincare", {"power": 2}),
    ("kappa", {"kappa": [-0.7, -0.2, -1.5]}),
    ("kappa", {"kappa": [0.4, 0.9, 0.1]}),
    ("kappa", {"kappa": 0.0}),
    ("product", {}),
    ("product", {"power": 2}),
    ("graded", {}),
    ("random_features", {}),
    ("operator", {}),
]


def ivf_list_attention(q, v, geometry, index, *, k=None, positions=None):
    """Attention over every key of the IVF lists each query probes (`ivf_block_attention`),
    in the inputs' space, as `retrieval_attention` computes it where queries probe some of the
    lists; called directly because where they probe every list `retrieval_attention` answers
    with dense attention instead. `k`: keys whose fresh witnesses are scored (for gradients to
    them or to the geometry); `positions`: causal."""
    from rewa.index.ivf_blocks import ivf_block_attention

    keys_w = None if k is None else geometry.witness(k)
    out, lse = ivf_block_attention(
        index, geometry.witness(q), v, keys_w=keys_w, positions=positions
    )
    return geometry.output_map(out), lse
