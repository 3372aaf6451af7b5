"""rewa.attention: geometries, exact dense attention returning `(out, lse)`, exact merging, and
the `GeometricAttention` module. Knows nothing of indexes or the service."""

from .dense import dense_attention
from .dot import DotProduct
from .euclidean import Euclidean
from .geometry import DistanceGeometry, Geometry, Lift, ScaledExpTemperature, SoftplusTemperature
from .merge import merge_attention
from .modules import GeometricAttention
from .operator import Operator, path_score, path_score_low_rank
from .poincare import PoincareBall
from .product import AdaptiveProductGeometry, ProductGeometry
from .random_features import RandomFeatures
from .registry import GEOMETRIES, make_geometry
from .sparse import sparse_attention
from .sphere import Sphere
from .stereographic import KappaStereographic

__all__ = [
    "GEOMETRIES",
    "AdaptiveProductGeometry",
    "DistanceGeometry",
    "DotProduct",
    "Euclidean",
    "GeometricAttention",
    "Geometry",
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
    "make_geometry",
    "merge_attention",
    "path_score",
    "path_score_low_rank",
    "sparse_attention",
]
