"""RiemannFormer (docs/mathematics.md 5, seed 003): parallel transport of embeddings (PaTE), metric
scaling outside the softmax, and locality focusing on values.

- PaTE, 1-D: SO(2) rotations of consecutive coordinate pairs `(2b, 2b + 1)` by `p theta_b`,
  `theta_b = base^(-2b/d)` (RoPE-like). 2-D: each block of four coordinates is a quaternion `x`
  and `R_b(p) x = u ⊗ x ⊗ w` with `u = exp(p_x theta_b a_b)`, `w = exp(p_y theta_b c_b)`
  (`a_b, c_b` unit pure quaternions, the axes). Left multiplication by `u` is
  `exp(p_x theta_b (a_b . J_L))` and right multiplication by `w` is `exp(p_y theta_b (c_b . J_R))`;
  left and right multiplications commute, so `R(p_i)^T R(p_j) = R(p_j - p_i)` and
  `<R(p_i) q, R(p_j) k>` depends only on `p_j - p_i`. `theta_b = base^(-4b/d)`.
- Metric scaling: `s_i = sqrt(alpha) sigmoid(w . x_i + b)` per head, `S = s s^T`,
  `out = (S ⊙ softmax(logits)) V`, i.e. `out_i = s_i sum_j a_ij (s_j v_j)`: values scaled by
  the key's `s_j`, the result by the query's `s_i` (not row-stochastic, by design).
- Locality focusing: `out_i = sum_j a_ij Lambda_ij v_j`, `Lambda_ij = exp(-||p_i - p_j||^2 /
  (2 sigma^2))`. With `(out', lse')` the attention under logits `l_ij + log Lambda_ij`,
  `out_i = exp(lse'_i - lse_i) out'_i` exactly, so both passes reuse the dense and sparse kernels
  (and their memory bounds and gradients) through the `LocalityBias` geometry.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
from torch import nn

from rewa.attention import GeometricAttention, Geometry, dense_attention, sparse_attention
from rewa.attention.geometry import Role, per_head

AxesKind = Literal["fixed", "shared", "learnable"]
TransportKind = Literal["so2", "so4"]


def quaternion_product(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Hamilton product of quaternions `(..., 4)` stored as `(w, x, y, z)`."""
    p0, p1, p2, p3 = p.unbind(-1)
    q0, q1, q2, q3 = q.unbind(-1)
    return torch.stack(
        (
            p0 * q0 - p1 * q1 - p2 * q2 - p3 * q3,
            p0 * q1 + p1 * q0 + p2 * q3 - p3 * q2,
            p0 * q2 - p1 * q3 + p2 * q0 + p3 * q1,
            p0 * q3 + p1 * q2 - p2 * q1 + p3 * q0,
        ),
        dim=-1,
    )


def isoclinic_generators(dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """`(J_L, J_R)`, each `(3, 4, 4)`: the matrices of left and right multiplication by the unit
    quaternions i, j, k. Every left generator commutes with every right generator, and each
    squares to `-I`."""
    basis = torch.eye(4, dtype=dtype)
    units = basis[1:]
    left = torch.stack([quaternion_product(u.expand(4, 4), basis).T for u in units])
    right = torch.stack([quaternion_product(basis, u.expand(4, 4)).T for u in units])
    return left, right


def _unit_quaternion(angle: torch.Tensor, axis: torch.Tensor) -> torch.Tensor:
    """`exp(angle * axis) = cos(angle) + sin(angle) axis` for unit pure-quaternion axes `(..., 3)`
    and angles broadcasting against `axis[..., 0]`."""
    vector = angle.sin().unsqueeze(-1) * axis
    scalar = angle.cos().unsqueeze(-1).expand(*vector.shape[:-1], 1)
    return torch.cat((scalar, vector), dim=-1)


class ParallelTransport(nn.Module):
    """PaTE rotations `R(p)` of queries and keys at positions `p` (docs/mathematics.md 5).

    Args:
        dim: head dimension `d`; even for `"so2"`, divisible by 4 for `"so4"`.
        heads: heads whose axes are learned separately (`axes="learnable"`).
        kind: `"so2"` (1-D positions `(..., N)`) or `"so4"` (2-D grid positions `(..., N, 2)`).
        base: frequency base; block `b` turns by `p theta_b`, `theta_b = base^(-2b/d)` (so2) or
            `base^(-4b/d)` (so4).
        axes: so4 only: `"fixed"` (a_b = c_b = i), `"shared"` (one learnable pair for every block
            and head) or `"learnable"` (a learnable pair per head and block).
        learn_frequencies: make `log theta_b` a parameter.
    """

    def __init__(
        self,
        dim: int,
        heads: int = 1,
        kind: TransportKind = "so2",
        *,
        base: float = 10000.0,
        axes: AxesKind = "fixed",
        learn_frequencies: bool = False,
    ) -> None:
        super().__init__()
        if kind not in ("so2", "so4"):
            raise ValueError(f"expected transport 'so2' or 'so4', got {kind!r}")
        if axes not in ("fixed", "shared", "learnable"):
            raise ValueError(f"expected axes 'fixed', 'shared' or 'learnable', got {axes!r}")
        block = 2 if kind == "so2" else 4
        if dim % block:
            raise ValueError(
                f"PaTE-{kind.upper()} needs a head dimension divisible by {block} "
                f"(blocks of {block} coordinates), got {dim}"
            )
        if base <= 1:
            raise ValueError(f"expected base > 1, got {base}")
        self.dim, self.heads, self.kind, self.axes_kind = dim, heads, kind, axes
        self.blocks = dim // block
        log_theta = -math.log(base) * torch.arange(self.blocks, dtype=torch.float64) * block / dim
        # float64 base frequencies (exact after .double()); a learnable offset when asked
        self.register_buffer("base_log_theta", log_theta, persistent=False)
        self.log_theta_offset = nn.Parameter(
            torch.zeros(self.blocks), requires_grad=learn_frequencies
        )
        if kind == "so4":
            shape = {"fixed": (1, 3), "shared": (1, 3), "learnable": (heads, self.blocks, 3)}[axes]
            if axes == "learnable":
                left, right = torch.randn(shape), torch.randn(shape)
            else:
                left = right = torch.tensor([[1.0, 0.0, 0.0]])
            trainable = axes != "fixed"
            self.left_axes = nn.Parameter(left.clone(), requires_grad=trainable)
            self.right_axes = nn.Parameter(right.clone(), requires_grad=trainable)

    def frequencies(self) -> torch.Tensor:
        """`theta_b` per block."""
        return (self.base_log_theta + self.log_theta_offset).exp()

    @property
    def position_dim(self) -> int:
        """Coordinates per position: 1 (so2) or 2 (so4)."""
        return 1 if self.kind == "so2" else 2

    def axes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Unit left and right axes `(..., 3)`: `(1, 3)` or `(heads, blocks, 3)`."""
        return (
            self.left_axes / self.left_axes.norm(dim=-1, keepdim=True),
            self.right_axes / self.right_axes.norm(dim=-1, keepdim=True),
        )

    def check_positions(self, positions: torch.Tensor, n: int) -> None:
        expected = (n,) if self.kind == "so2" else (n, 2)
        trailing = positions.shape[-len(expected) :] if positions.dim() >= len(expected) else None
        if trailing != expected:
            raise ValueError(
                f"expected {self.kind} positions of shape (..., {', '.join(map(str, expected))}) "
                f"for {n} tokens, got {tuple(positions.shape)}"
            )

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate `x (..., N, d)` at `positions` `(..., N)` (so2) or `(..., N, 2)` (so4), which
        broadcast against x's leading dimensions: `(N,)` for every batch and head, `(B, 1, N)` per
        batch element of `(B, H, N, d)` inputs. Per-head axes expect heads third from the end."""
        if x.shape[-1] != self.dim:
            raise ValueError(f"expected vectors of dimension {self.dim}, got {x.shape[-1]}")
        self.check_positions(positions, x.shape[-2])
        theta = self.frequencies().to(x.dtype)
        positions = positions.to(x.dtype)
        if self.kind == "so2":
            angle = positions.unsqueeze(-1) * theta  # (..., N, blocks)
            pairs = x.unflatten(-1, (self.blocks, 2))
            cos, sin = angle.cos(), angle.sin()
            even, odd = pairs[..., 0], pairs[..., 1]
            rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
            return rotated.flatten(-2)
        left_axes, right_axes = (a.to(x.dtype) for a in self.axes())
        if self._per_head_axes:
            left_axes, right_axes = left_axes.unsqueeze(-3), right_axes.unsqueeze(-3)
        left = _unit_quaternion(positions[..., 0:1] * theta, left_axes)  # (..., N, blocks, 4)
        right = _unit_quaternion(positions[..., 1:2] * theta, right_axes)
        blocks = x.unflatten(-1, (self.blocks, 4))
        return quaternion_product(quaternion_product(left, blocks), right).flatten(-2)

    def matrix(self, positions: torch.Tensor) -> torch.Tensor:
        """The rotation matrices at `positions` `(N,)` (so2) or `(N, 2)` (so4): `(N, d, d)`, or
        `(heads, N, d, d)` with per-head axes; column m is the rotated basis vector e_m."""
        n = positions.shape[0]
        basis = torch.eye(self.dim, dtype=positions.dtype, device=positions.device)  # row m: e_m
        shape = (
            (self.dim, self.heads, n, self.dim) if self._per_head_axes else (self.dim, n, self.dim)
        )
        columns = basis.reshape(self.dim, *([1] * (len(shape) - 2)), self.dim).expand(shape)
        return self.forward(columns, positions).movedim(0, -1)

    @property
    def _per_head_axes(self) -> bool:
        return self.kind == "so4" and self.axes_kind == "learnable" and self.heads > 1

    def extra_repr(self) -> str:
        return f"dim={self.dim}, kind={self.kind}, axes={self.axes_kind}"


class MetricScaling(nn.Module):
    """Content-dependent metric scaling `s = sqrt(alpha) sigmoid(W x + b)`, one scale per head and
    token: `x (..., N, E)` -> `s (..., heads, N)`. `alpha = 4` makes `S = s s^T` start near 1."""

    def __init__(self, embed_dim: int, heads: int, alpha: float = 4.0) -> None:
        super().__init__()
        if alpha <= 0:
            raise ValueError(f"expected alpha > 0, got {alpha}")
        self.alpha = float(alpha)
        self.proj = nn.Linear(embed_dim, heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return math.sqrt(self.alpha) * torch.sigmoid(self.proj(x)).transpose(-1, -2)


class LocalityBias(Geometry):
    """A geometry's logits plus `log Lambda_ij = -||p_i - p_j||^2 / (2 sigma^2)`, for inputs that
    carry their positions in `position_dim` trailing columns. `sigma` is per head (learnable when
    `learn_sigma`). Used by `riemann_attention`'s locality-focusing pass; ranks like the base
    geometry only when positions are equal, so it has no lift."""

    exact_lift = False

    def __init__(
        self,
        base: Geometry,
        sigma: float | torch.Tensor,
        position_dim: int = 1,
        *,
        learn_sigma: bool = False,
    ) -> None:
        super().__init__(base.dim + position_dim, base.heads)
        sigma = torch.as_tensor(sigma).flatten()
        if not sigma.is_floating_point():
            sigma = sigma.to(torch.get_default_dtype())
        if sigma.numel() not in (1, base.heads) or not bool((sigma > 0).all()):
            raise ValueError(
                f"expected a positive sigma, one or one per head ({base.heads}), got "
                f"{sigma.tolist()}"
            )
        self.base = base
        self.position_dim = position_dim
        self.log_sigma = nn.Parameter(
            sigma.log().expand(base.heads).clone(), requires_grad=learn_sigma
        )

    def sigma(self) -> torch.Tensor:
        return self.log_sigma.exp()

    def _split(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return w[..., : -self.position_dim], w[..., -self.position_dim :]

    def witness(self, x: torch.Tensor) -> torch.Tensor:
        vectors, positions = self._split(x)
        return torch.cat((self.base.witness(vectors), positions), dim=-1)

    def _bias(self, squared_distance: torch.Tensor) -> torch.Tensor:
        inverse = per_head(1 / (2 * self.sigma().square())).to(squared_distance.dtype)
        return squared_distance * -inverse

    def score(self, qw: torch.Tensor, kw: torch.Tensor) -> torch.Tensor:
        (qv, qp), (kv, kp) = self._split(qw), self._split(kw)
        squared = (qp.unsqueeze(-2) - kp.unsqueeze(-3)).square().sum(-1)
        return self.base.score(qv, kv) + self._bias(squared)

    def score_at(self, qw: torch.Tensor, kw: torch.Tensor) -> torch.Tensor:
        (qv, qp), (kv, kp) = self._split(qw), self._split(kw)
        squared = (qp.unsqueeze(-2) - kp).square().sum(-1)
        return self.base.score_at(qv, kv) + self._bias(squared)

    def output_map(self, out: torch.Tensor) -> torch.Tensor:
        return self.base.output_map(out)

    def lift(self, w: torch.Tensor, role: Role):
        raise TypeError("LocalityBias has no lift: search with the base geometry's index")


def _with_positions(x: torch.Tensor, positions: torch.Tensor, position_dim: int) -> torch.Tensor:
    if position_dim == 1 and positions.shape[-1:] == x.shape[-2:-1]:
        positions = positions.unsqueeze(-1)
    positions = positions.to(x.dtype).expand(*x.shape[:-1], position_dim)
    return torch.cat((x, positions), dim=-1)


def riemann_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    geometry: Geometry,
    *,
    query_scale: torch.Tensor | None = None,
    key_scale: torch.Tensor | None = None,
    locality: LocalityBias | None = None,
    query_positions: torch.Tensor | None = None,
    key_positions: torch.Tensor | None = None,
    candidates: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RiemannFormer attention on (already transported) queries and keys: metric scaling and
    locality focusing around softmax attention under `geometry`.

    Args:
        q, k, v: `(..., Nq, d)`, `(..., Nk, d)`, `(..., Nk, dv)`.
        query_scale, key_scale: metric scales `s` `(..., Nq)` and `(..., Nk)`; both or neither.
        locality: a `LocalityBias` over `geometry` (its sigma); needs `query_positions` and
            `key_positions` `(..., N)` or `(..., N, P)`.
        candidates: key ids `(..., Nq, C)` (`-1` padding) for the sparse path, which attends
            exactly these keys (both passes of locality focusing must see one key set, so no
            top-K re-selection happens here: search the index for the top K first).
        mask, causal: as in `dense_attention` (dense path only).

    Returns:
        `out (..., Nq, dv)` and `lse (..., Nq)`, the log-partition of the plain softmax (before
        scaling and focusing, which make the weights non-stochastic).
    """
    if (query_scale is None) != (key_scale is None):
        raise ValueError("metric scaling needs both query_scale and key_scale")
    if candidates is not None and (mask is not None or causal):
        raise ValueError("mask and causal apply to the dense path; filter candidates instead")

    def attend(qx, kx, vx, geom):
        if candidates is None:
            return dense_attention(qx, kx, vx, geom, mask, causal)
        return sparse_attention(qx, kx, vx, geom, candidates, max(candidates.shape[-1], 1))

    values = v if key_scale is None else v * key_scale.unsqueeze(-1).to(v.dtype)
    out, lse = attend(q, k, values, geometry)
    if locality is not None:
        if locality.base is not geometry:
            raise ValueError("the LocalityBias must wrap the geometry being attended")
        if query_positions is None or key_positions is None:
            raise ValueError("locality focusing needs query_positions and key_positions")
        focused, focused_lse = attend(
            _with_positions(q, query_positions, locality.position_dim),
            _with_positions(k, key_positions, locality.position_dim),
            values,
            locality,
        )
        finite = torch.isfinite(lse)
        ratio = torch.where(finite, focused_lse - torch.where(finite, lse, 0), float("-inf")).exp()
        out = focused * ratio.unsqueeze(-1).to(focused.dtype)
    if query_scale is not None:
        out = out * query_scale.unsqueeze(-1).to(out.dtype)
    return out, lse


class RiemannAttention(GeometricAttention):
    """RiemannFormer multi-head attention: PaTE on queries and keys, any geometry, metric scaling
    outside the softmax and locality focusing on values (docs/mathematics.md 5).

    Args (besides `GeometricAttention`'s):
        transport: `"so2"` (1-D positions, default), `"so4"` (2-D grid positions `(N, 2)`) or
            None (no rotation).
        axes, base, learn_frequencies: see `ParallelTransport`.
        metric_scaling: learn `s_i = sqrt(alpha) sigmoid(w . x_i + b)` per head.
        alpha: the metric-scaling bound.
        locality_sigma: focus values with `exp(-||p_i - p_j||^2 / (2 sigma^2))`; None disables.
        learn_sigma: make sigma a per-head parameter.

    `forward(query, key=None, value=None, positions=None, key_positions=None, mask=None,
    causal=False, need_lse=False)`: positions default to `arange(N)` for 1-D transport and are
    required for 2-D.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        geometry: str | Geometry = "dot",
        *,
        transport: TransportKind | None = "so2",
        axes: AxesKind = "fixed",
        base: float = 10000.0,
        learn_frequencies: bool = False,
        metric_scaling: bool = True,
        alpha: float = 4.0,
        locality_sigma: float | None = None,
        learn_sigma: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(embed_dim, num_heads, geometry, **kwargs)
        self.transport = (
            None
            if transport is None
            else ParallelTransport(
                self.head_dim,
                num_heads,
                transport,
                base=base,
                axes=axes,
                learn_frequencies=learn_frequencies,
            )
        )
        self.position_dim = 2 if transport == "so4" else 1
        self.scaling = MetricScaling(embed_dim, num_heads, alpha) if metric_scaling else None
        self.locality = (
            None
            if locality_sigma is None
            else LocalityBias(
                self.geometry, locality_sigma, self.position_dim, learn_sigma=learn_sigma
            )
        )

    def _positions(self, positions: torch.Tensor | None, n: int, device) -> torch.Tensor:
        """Positions `(N,)` / `(N, 2)`, or per batch element `(B, N)` / `(B, N, 2)` given a head
        axis so that they broadcast against `(B, H, N, d)`."""
        if positions is None:
            if self.position_dim == 2:
                raise ValueError("2-D (so4) attention needs grid positions (N, 2)")
            return torch.arange(n, device=device, dtype=torch.float32)
        rank = 1 if self.position_dim == 1 else 2
        expected = (n,) if rank == 1 else (n, 2)
        if positions.dim() not in (rank, rank + 1) or tuple(positions.shape[-rank:]) != expected:
            raise ValueError(
                f"expected positions of shape {expected} or (B, {', '.join(map(str, expected))}),"
                f" got {tuple(positions.shape)}"
            )
        return positions.unsqueeze(1) if positions.dim() == rank + 1 else positions

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        key_positions: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        causal: bool = False,
        need_lse: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        key_input = query if key is None else key
        query_positions = self._positions(positions, query.shape[-2], query.device)
        if key_positions is None and key is None:
            key_positions = positions
        key_positions = self._positions(key_positions, key_input.shape[-2], query.device)
        q, k, v = self.project(query, key, value)
        if self.transport is not None:
            q = self.transport(q, query_positions)
            k = self.transport(k, key_positions)
        scales = {}
        if self.scaling is not None:
            query_scale = self.scaling(query)
            key_scale = query_scale if key is None else self.scaling(key_input)
            scales = {"query_scale": query_scale, "key_scale": key_scale}
        out, lse = riemann_attention(
            q,
            k,
            v,
            self.geometry,
            locality=self.locality,
            query_positions=query_positions,
            key_positions=key_positions,
            mask=mask,
            causal=causal,
            **scales,
        )
        return self.merge_heads(out, lse, need_lse)
