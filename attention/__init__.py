"""rewa.attention: geometries, exact dense attention returning `(out, lse)`, exact merging, and
the `GeometricAttention` module. Knows nothing of indexes or the service."""

from .cone import Cone, penumbral_height, umbral_height
from .dense import dense_attention
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
from .graded import (
    Graded,
    annealed_lambda,
    grade_inputs,
    grade_learning_rate_bound,
    grade_regularizer,
    grade_weights,
    graded_loss,
    graded_positional_encoding,
    head_coordination_loss,
    sinusoidal_encoding,
)
from .layers import GeometricTransformerLayer, GeometryMixture
from .merge import merge_attention
from .modules import GeometricAttention
from .operator import Operator, path_score, path_score_low_rank
from .poincare import PoincareBall
from .product import AdaptiveProductGeometry, ProductGeometry
from .random_features import RandomFeatures
from .registry import GEOMETRIES, make_geometry
from .riemann import (
    LocalityBias,
    MetricScaling,
    ParallelTransport,
    RiemannAttention,
    isoclinic_generators,
    quaternion_product,
    riemann_attention,
)
from .sparse import sparse_attention
from .sphere import Sphere
from .stereographic import KappaStereographic, expmap
from .training import (
    CURRICULUM_PHASES,
    GeometricCurriculum,
    Phase,
    RiemannianSGD,
    component_group,
    riemannian_gradient,
)

__all__ = [
    "CURRICULUM_PHASES",
    "GEOMETRIES",
    "AdaptiveProductGeometry",
    "Cone",
    "DistanceGeometry",
    "DomainError",
    "DotProduct",
    "Euclidean",
    "GeometricAttention",
    "GeometricCurriculum",
    "GeometricTransformerLayer",
    "Geometry",
    "GeometryMixture",
    "Graded",
    "KappaStereographic",
    "Lift",
    "LocalityBias",
    "MetricScaling",
    "Operator",
    "ParallelTransport",
    "Phase",
    "PoincareBall",
    "ProductGeometry",
    "RandomFeatures",
    "RiemannAttention",
    "RiemannianSGD",
    "ScaledExpTemperature",
    "SoftplusTemperature",
    "Sphere",
    "annealed_lambda",
    "component_group",
    "dense_attention",
    "expmap",
    "grade_inputs",
    "grade_learning_rate_bound",
    "grade_regularizer",
    "grade_weights",
    "graded_loss",
    "graded_positional_encoding",
    "head_coordination_loss",
    "isoclinic_generators",
    "make_geometry",
    "merge_attention",
    "path_score",
    "path_score_low_rank",
    "penumbral_height",
    "quaternion_product",
    "riemann_attention",
    "riemannian_gradient",
    "sinusoidal_encoding",
    "sparse_attention",
    "umbral_height",
]
