"""Geometries by name, so that a geometry can be described as data (`{"name": ..., **options}`)
by a configuration file, a module argument or a service request."""

from __future__ import annotations

import inspect
from typing import Any

from .cone import Cone
from .dot import DotProduct
from .euclidean import Euclidean
from .geometry import Geometry
from .graded import Graded
from .operator import Operator
from .poincare import PoincareBall
from .product import AdaptiveProductGeometry, ProductGeometry
from .random_features import RandomFeatures
from .sphere import Sphere
from .stereographic import KappaStereographic

GEOMETRIES: dict[str, type[Geometry]] = {
    "dot": DotProduct,
    "euclidean": Euclidean,
    "sphere": Sphere,
    "poincare": PoincareBall,
    "kappa": KappaStereographic,
    "product": ProductGeometry,
    "adaptive_product": AdaptiveProductGeometry,
    "random_features": RandomFeatures,
    "operator": Operator,
    "cone": Cone,
    "graded": Graded,
}


def make_geometry(name: str, dim: int, heads: int = 1, **options: Any) -> Geometry:
    """Build the geometry registered as `name` for head dimension `dim` and `heads` heads.

    Raises ValueError naming the unknown geometry or option and what is accepted.
    """
    if name not in GEOMETRIES:
        raise ValueError(f"unknown geometry {name!r}; expected one of {sorted(GEOMETRIES)}")
    cls = GEOMETRIES[name]
    accepted = _options_of(cls)
    unknown = sorted(set(options) - accepted)
    if unknown:
        raise ValueError(
            f"unknown option(s) {unknown} for geometry {name!r}; expected a subset of "
            f"{sorted(accepted)}"
        )
    return cls(dim=dim, heads=heads, **options)


def _options_of(cls: type) -> set[str]:
    accepted: set[str] = set()
    for klass in cls.__mro__:
        if klass is Geometry:
            break
        parameters = inspect.signature(klass.__init__).parameters.values()
        accepted |= {
            p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        }
    return accepted - {"self", "dim", "heads"}
