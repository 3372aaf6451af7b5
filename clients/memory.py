"""`RemoteMemory`: a stored context as an external memory of a local model.

A layer that attends a local window of keys exactly can add a long remote context without
holding it: `RemoteMemory` sends the layer's queries to the service and gets back `(out, lse)`,
and `merge_attention` (docs/mathematics.md 7) combines them with the local attention's `(out, lse)`
exactly, as if one softmax had covered both key sets."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch import nn

from rewa.attention import merge_attention

from .http import Client

__all__ = ["RemoteMemory", "ShardedMemory", "merge_attention"]


class RemoteMemory(nn.Module):
    """Attention of queries `(heads, n, head_dim)` over the context `context_id` of a rewa
    service: `attend(queries)` (or calling the module) returns `(out (heads, n, value_dim), lse
    (heads, n))` on the queries' device and dtype. `mode` and the other options are the attend
    endpoint's (`tail` by default; `exact` for dense attention over the whole context).

    It has the interface of the in-process `rewa.index.LocalMemory`: `append(keys, values)`
    commits tokens (one new version of the context; the service extends its indexes), `n_tokens`,
    `audit_report()` (the service's audit) and `close()`, which deletes the context when this
    memory created it (`RemoteMemory.create`).

    The remote keys and values are constants and no gradient flows through the HTTP call: the
    outputs are detached. Use it where the memory is read, not trained."""

    def __init__(
        self,
        client: Client,
        context_id: str,
        *,
        mode: str = "tail",
        owned: bool = False,
        **options: Any,
    ):
        super().__init__()
        self.client = client
        self.context_id = context_id
        self.mode = mode
        self.options = options
        self.owned = owned
        self._n_tokens: int | None = None

    @classmethod
    def create(
        cls,
        client: Client,
        heads: int,
        head_dim: int,
        *,
        value_dim: int | None = None,
        geometry: str | dict = "dot",
        mode: str = "tail",
        name: str | None = None,
        geometry_state: dict | None = None,
        **options: Any,
    ) -> RemoteMemory:
        """A new empty context on the service, owned by the memory (`close()` deletes it);
        `geometry_state` a trained geometry's `state_dict()`; `options` are the attend
        endpoint's (`budget`, `top_k`, ...)."""
        context = client.create_context(
            heads,
            head_dim,
            geometry=geometry,
            value_dim=value_dim,
            name=name,
            geometry_state=geometry_state,
        )
        memory = cls(client, context["id"], mode=mode, owned=True, **options)
        memory._n_tokens = 0
        return memory

    @property
    def n_tokens(self) -> int:
        if self._n_tokens is None:
            self._n_tokens = self.client.get_context(self.context_id)["n_tokens"]
        return self._n_tokens

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Commit keys `(heads, n, head_dim)` and values `(heads, n, value_dim)` as the next
        version of the context (nothing of them is visible if the upload fails)."""
        context = self.client.upload(self.context_id, keys.detach(), values.detach())
        self._n_tokens = context["n_tokens"]

    def attend(self, queries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if queries.dim() != 3:
            raise ValueError(f"expected queries (heads, n, head_dim), got {tuple(queries.shape)}")
        result = self.client.attend(
            self.context_id, queries.detach(), mode=self.mode, **self.options
        )
        return (
            result.out.to(queries.device, queries.dtype),
            result.lse.to(queries.device, queries.dtype),
        )

    def forward(self, queries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.attend(queries)

    def wait_for_index(self) -> None:
        """Wait until the service has built the index of this memory's mode over the latest
        version (`Client.build_index`): attends that come before read the keys it does not
        cover yet exactly, or wait (docs/indexes.md, "Builds in the background"). Nothing to
        wait for in `exact` mode or while the context is empty."""
        if self.mode != "exact" and self.n_tokens > 0:
            self.client.build_index(self.context_id, [self.mode])

    def audit_report(self) -> list[dict]:
        """Per head, what the audit of the replica that answers measured of this context
        (`REWA_AUDIT_EVERY`; docs/service.md, "The audit"), as `LocalMemory.audit_report`:
        `audited`, `err_median`, `err_p99`, `settled` and `max_keys`. ValueError when the
        service does not audit."""
        return context_audit(self.client, self.context_id)

    def close(self) -> None:
        """Delete the context if this memory created it; otherwise leave it."""
        if self.owned:
            self.client.delete_context(self.context_id)
            self.owned = False
        self._n_tokens = None

    def extra_repr(self) -> str:
        return f"context_id={self.context_id!r}, mode={self.mode!r}, url={self.client.url!r}"


def context_audit(client: Client, context_id: str) -> list[dict]:
    """Per stored head of a context, what the audit of the replica that answers measured
    (`index_state`'s `audit`). ValueError when the service does not audit."""
    audit = client.index_state(context_id).get("audit")
    if audit is None:
        raise ValueError("the service does not audit: run it with REWA_AUDIT_EVERY >= 1")
    return audit


class ShardedMemory(nn.Module):
    """One long context stored as several contexts, its shards (disjoint parts of its tokens, on
    one service or on several, e.g. when the whole does not fit one device):
    `forward(queries) -> (out, lse)` asks every shard at once and merges the answers with
    `merge_attention`. In `exact` mode the result is exactly attention over the whole context;
    in the sparse modes each shard's estimate is merged the same way."""

    def __init__(self, shards: Sequence[RemoteMemory]):
        super().__init__()
        if not shards:
            raise ValueError("ShardedMemory needs at least one shard")
        self.shards = nn.ModuleList(shards)

    def forward(self, queries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with ThreadPoolExecutor(max_workers=len(self.shards)) as pool:
            parts = list(pool.map(lambda shard: shard(queries), self.shards))
        return merge_attention(*parts)
