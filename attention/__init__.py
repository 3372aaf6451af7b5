"""rewa.attention: geometries, exact dense attention returning `(out, lse)`, sparse attention,
exact merging, and the `GeometricAttention` module: what the serving core computes. Knows
nothing of indexes or the service. Research code built on it (RiemannFormer, the mixture and
transformer layers, training aids) is `rewa.research`."""

from .cone import Cone, penumbral_height, umbral_height
from .dense import dense_attention, witness_attention
from .dot import DotProduct
from .euclidean import Euclidean
from .geometry import (
    DistanceGeometry,
    DomainError,
    Geometry,
    Lift,
    ScaledExpTemperature,
    SoftplusTemperature,
)
from .graded import Graded
from .merge import merge_attention, merge_stacked
from .modules import GeometricAttention
from .operator import Operator, path_score, path_score_low_rank
from .poincare import PoincareBall
from .product import AdaptiveProductGeometry, ProductGeometry
from .random_features import RandomFeatures
from .registry import GEOMETRIES, make_geometry
from .sparse import sparse_attention
from .sphere import Sphere
from .stereographic import KappaStereographic, expmap

__all__ = [
    "GEOMETRIES",
    "AdaptiveProductGeometry",
    "Cone",
    "DistanceGeometry",
    "DomainError",
    "DotProduct",
    "Euclidean",
    "GeometricAttention",
    "Geometry",
    "Graded",
    "KappaStereographic",
    "Lift",
    "Operator",
    "PoincareBall",
    "ProductGeometry",
    "RandomFeatures",
    "ScaledExpTemperature",
    "SoftplusTemperature",
    "Sphere",
    "dense_attention",
    "expmap",
    "make_geometry",
    "merge_attention",
    "merge_stacked",
    "path_score",
    "path_score_low_rank",
    "penumbral_height",
    "sparse_attention",
    "umbral_height",
    "witness_attention",
]
