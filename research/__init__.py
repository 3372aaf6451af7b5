"""rewa.research: mechanisms built on rewa.attention that the serving core does not use.

RiemannFormer (parallel transport, metric scaling, locality bias, `RiemannAttention`), the
mixture of geometries and the geometric transformer layer, the training aids (curriculum,
Riemannian gradients and SGD), and graded attention's training aids (grade weights, encodings,
regularisers and schedules; the `Graded` geometry itself is in rewa.attention). docs/library.md
describes them; benchmarks/hierarchy.py is the experiment that uses them."""

from rewa.attention.graded import (
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
from .riemann import (
    LocalityBias,
    MetricScaling,
    ParallelTransport,
    RiemannAttention,
    isoclinic_generators,
    quaternion_product,
    riemann_attention,
)
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
    "GeometricCurriculum",
    "GeometricTransformerLayer",
    "GeometryMixture",
    "LocalityBias",
    "MetricScaling",
    "ParallelTransport",
    "Phase",
    "RiemannAttention",
    "RiemannianSGD",
    "annealed_lambda",
    "component_group",
    "grade_inputs",
    "grade_learning_rate_bound",
    "grade_regularizer",
    "grade_weights",
    "graded_loss",
    "graded_positional_encoding",
    "head_coordination_loss",
    "isoclinic_generators",
    "quaternion_product",
    "riemann_attention",
    "riemannian_gradient",
    "sinusoidal_encoding",
]
