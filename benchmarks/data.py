"""Seeded benchmark data sets shared by tests and benchmarks.

Each data set is queries, keys and values for one head plus the geometry its attention is
defined in, with a fixed temperature chosen so that dense attention is neither one-hot (trivial
for top K) nor uniform: the median effective support exp(entropy) of its rows lies between 8 and
32 keys (`overlapping`, the harder set, is broader). `median_support` measures it.

- `clustered`: a Gaussian mixture in R^d (topics), dot-product attention. One mixture component
  per 256 keys, so the difficulty does not change with N. Queries are fresh draws from the same
  mixture, scaled by 4.0 (the temperature). Median effective support (seed 0): 17.0 keys at
  N = 8192, 20.4 at 32768, 18.2 at 131072.
- `overlapping`: a harder Gaussian mixture, dot-product attention: one broad component per 1024
  keys whose centres (spread 0.5) are as far apart as the noise (0.5) is wide, so components
  overlap and no cluster boundary is clean. Queries are fresh draws scaled by 3.0. It was added
  after the index defaults were chosen, to check them on data they were not tuned on. Its
  attention is broad, unlike the other two: median effective support (seed 0) 660 keys at
  N = 8192, 1042 at 32768, 5234 at 131072.
- `tree`: a balanced tree (branching 4) embedded in the Poincare ball, hierarchy; attention with
  the Poincare geometry. Nodes are built in the tangent space at the origin (children step away
  from their parent, farther at depth), keys and queries are noisy copies of random nodes, and
  the geometry's witness map (`project(expmap0(x))`) carries them into the ball (steps are short
  enough that no point reaches the projection boundary: largest norm 0.89); about 16 copies per
  node, temperature 0.06. Median effective support (seed 0): 11.8 keys at N = 8192, 12.2 at
  32768, 10.6 at 131072.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from rewa.attention import Geometry, dense_attention, make_geometry

CLUSTER_SIZE = 256
CLUSTERED_QUERY_SCALE = 4.0
OVERLAPPING_COMPONENT_SIZE = 1024
OVERLAPPING_QUERY_SCALE = 3.0
TREE_TEMPERATURE = 0.06


@dataclass
class AttentionData:
    """Queries `(n, d)`, keys `(n, d)`, values `(n, dv)` and the geometry of their attention."""

    name: str
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    geometry_spec: dict[str, Any] = field(default_factory=dict)

    def geometry(self) -> Geometry:
        spec = dict(self.geometry_spec)
        return make_geometry(spec.pop("name"), self.q.shape[-1], **spec)


def clustered(n: int, d: int = 64, seed: int = 0) -> AttentionData:
    generator = torch.Generator().manual_seed(seed)
    n_clusters = max(1, n // CLUSTER_SIZE)
    centers = torch.randn(n_clusters, d, generator=generator)
    noise = 0.6

    def draw() -> torch.Tensor:
        labels = torch.randint(n_clusters, (n,), generator=generator)
        return centers[labels] + noise * torch.randn(n, d, generator=generator)

    k = draw()
    q = draw() * CLUSTERED_QUERY_SCALE
    v = torch.randn(n, d, generator=generator)
    return AttentionData("clustered", q, k, v, {"name": "dot"})


def overlapping(n: int, d: int = 64, seed: int = 0) -> AttentionData:
    generator = torch.Generator().manual_seed(seed)
    n_components = max(1, n // OVERLAPPING_COMPONENT_SIZE)
    centers = 0.5 * torch.randn(n_components, d, generator=generator)

    def draw() -> torch.Tensor:
        labels = torch.randint(n_components, (n,), generator=generator)
        return centers[labels] + 0.5 * torch.randn(n, d, generator=generator)

    k = draw()
    q = draw() * OVERLAPPING_QUERY_SCALE
    v = torch.randn(n, d, generator=generator)
    return AttentionData("overlapping", q, k, v, {"name": "dot"})


def tree(n: int, d: int = 64, seed: int = 0, branching: int = 4) -> AttentionData:
    generator = torch.Generator().manual_seed(seed)
    depth = max(1, math.ceil(math.log(max(n, 2), branching)))
    levels = [torch.zeros(1, d)]
    for level in range(1, depth + 1):
        parents = levels[-1].repeat_interleave(branching, dim=0)
        directions = torch.randn(parents.shape[0], d, generator=generator)
        directions = directions / directions.norm(dim=-1, keepdim=True)
        levels.append(parents + directions * (0.25 + 0.04 * level))
        if sum(len(x) for x in levels) >= n // 16:
            break
    nodes = torch.cat(levels)

    def draw() -> torch.Tensor:
        picks = torch.randint(len(nodes), (n,), generator=generator)
        return nodes[picks] + 0.08 * torch.randn(n, d, generator=generator)

    k, q = draw(), draw()
    v = torch.randn(n, d, generator=generator)
    return AttentionData(
        "tree",
        q,
        k,
        v,
        {"name": "poincare", "temperature": "softplus", "tau_init": TREE_TEMPERATURE},
    )


DATASETS = {"clustered": clustered, "overlapping": overlapping, "tree": tree}


def median_support(data: AttentionData, n_queries: int = 512) -> float:
    """Median over queries of exp(entropy) of their exact dense attention rows."""
    geometry = data.geometry()
    with torch.no_grad():
        logits = geometry.logits(data.q[:n_queries], data.k)
        weights = torch.softmax(logits, dim=-1)
        entropy = -(weights * torch.log(weights.clamp_min(1e-30))).sum(-1)
    return entropy.exp().median().item()


def dense_reference(data: AttentionData) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact dense attention `(out, lse)` of the data set under its geometry."""
    with torch.no_grad():
        return dense_attention(data.q, data.k, data.v, data.geometry())
