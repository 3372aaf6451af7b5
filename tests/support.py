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
