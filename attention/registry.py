"""Geometries by name, so that a geometry can be described as data (`{"name": ..., **options}`)
by a configuration file, a module argument or a service request."""

from __future__ import annotations

import functools
import inspect
import math
import types
import typing
from collections import abc
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

    Raises ValueError naming the unknown geometry or option and what is accepted, or an option
    whose value does not have the type its constructor declares (`check_option`).
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
    types = _option_types(cls)
    for option, value in options.items():
        if option in types and not check_option(option, value, types[option]):
            raise ValueError(
                f"option {option!r} of geometry {name!r}: expected {_describe(types[option])}, "
                f"got {value!r}"
            )
    return cls(dim=dim, heads=heads, **options)


MAX_SIZE_OPTION = 1 << 16
"""The largest integer option (a map width, a rank, a number of features): beyond it the
parameters alone would take gigabytes."""
MAX_FLOAT_OPTION = 1e6
"""The largest magnitude of a real option (curvatures, temperatures, radii, scales)."""
MAX_SEQUENCE_OPTION = 4096
"""The longest list option (per-head values)."""


def check_option(name: str, value: Any, annotation: Any) -> bool:
    """Whether `value` (as it arrives from JSON or Python) has the type `annotation` declares:
    bool for bool, an integer in `[-MAX_SIZE_OPTION, MAX_SIZE_OPTION]` for int (a seed: any
    integer in `[0, 2^63)`), a finite number of magnitude at most `MAX_FLOAT_OPTION` for float,
    one of the values of a Literal, a non-empty list of at most `MAX_SEQUENCE_OPTION` such
    values for a Sequence, and any member for a union."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(check_option(name, value, member) for member in args)
    if origin is typing.Literal:
        return any(value == choice and type(value) is type(choice) for choice in args)
    if origin is not None and isinstance(origin, type) and issubclass(origin, abc.Sequence):
        member = args[0] if args else float
        return (
            isinstance(value, list | tuple)
            and 0 < len(value) <= MAX_SEQUENCE_OPTION
            and all(check_option(name, item, member) for item in value)
        )
    if annotation is abc.Sequence:
        return check_option(name, value, abc.Sequence[float])
    if annotation is type(None):
        return value is None
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            return False
        return 0 <= value < 2**63 if name == "seed" else abs(value) <= MAX_SIZE_OPTION
    if annotation is float:
        return (
            isinstance(value, int | float)
            and not isinstance(value, bool)
            and math.isfinite(value)
            and abs(value) <= MAX_FLOAT_OPTION
        )
    if annotation is str:
        return isinstance(value, str)
    if isinstance(annotation, type):
        return isinstance(value, annotation)  # e.g. a tensor passed in Python
    return True


def _describe(annotation: Any) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(member) for member in args)
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(choice) for choice in args)
    if origin is not None and isinstance(origin, type) and issubclass(origin, abc.Sequence):
        return (
            f"a list of at most {MAX_SEQUENCE_OPTION} of ({_describe(args[0] if args else float)})"
        )
    if annotation is abc.Sequence:
        return f"a list of at most {MAX_SEQUENCE_OPTION} numbers"
    if annotation is int:
        return f"an integer of magnitude <= {MAX_SIZE_OPTION}"
    if annotation is float:
        return f"a finite number of magnitude <= {MAX_FLOAT_OPTION:g}"
    if annotation is type(None):
        return "null"
    return getattr(annotation, "__name__", str(annotation))


@functools.cache
def _option_types(cls: type) -> dict[str, Any]:
    """Each option's declared type, from the constructors along the class's MRO."""
    found: dict[str, Any] = {}
    for klass in cls.__mro__:
        if klass is Geometry:
            break
        hints = typing.get_type_hints(klass.__init__)
        for option, hint in hints.items():
            if option not in ("return", "dim", "heads"):
                found.setdefault(option, hint)
    return found


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
