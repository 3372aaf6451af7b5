"""Every layer's memory in one multi-layer document on a rewa service (docs/llm.md, "Multi-layer
documents"): one context for the whole model, one commit per spill for all layers, deleted as
one unit.

A model's layers spill the same tokens, but one after another within a forward pass, and a
commit must hold every layer's keys. So a layer's spilled tokens are staged in the process until
the last layer has spilled them too, and then committed together. Until then the layer reads its
staged tokens exactly, here, and merges them with the document's answer for its layer: the
attention is the same as if they had been committed at once. While decoding, at most one spill
of each layer is staged; in a long prompt's forward pass every layer but the last reads the
prompt's spilled tokens exactly (dense cost) until the last layer commits them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from rewa.attention import merge_attention
from rewa.clients import Client
from rewa.clients.memory import context_audit

from .exact import exact_part


class RemoteDocument:
    """A multi-layer context created at the first spill of the first layer, holding the memory
    layers `layers` (model layer indexes) in that order. `options` are the attend endpoint's
    (`mode`, `budget`, `top_k`...)."""

    def __init__(self, client: Client, layers: Sequence[int], **options: Any) -> None:
        if not layers or len(set(layers)) != len(layers):
            raise ValueError(f"expected distinct memory layers, got {list(layers)}")
        self.client = client
        self.layers = list(layers)
        self.options = options
        self.context_id: str | None = None
        self.shape: tuple[int, int, int, float] | None = None  # heads, head_dim, value_dim, scale
        self.committed = 0
        self.made: set[int] = set()  # the layers whose memory `memory` made
        self.staged: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {
            layer: [] for layer in self.layers
        }

    def memory(self, layer: int, heads: int, head_dim: int, value_dim: int, scale: float):
        """The memory of model layer `layer` (a `MemoryFactory`)."""
        if layer not in self.staged:
            raise ValueError(f"layer {layer} is not among the document's layers {self.layers}")
        if layer in self.made:
            raise ValueError(
                f"layer {layer} of the document has its memory already: a document holds one "
                "sequence (batch size 1)"
            )
        self.made.add(layer)
        shape = (heads, head_dim, value_dim, scale)
        if self.shape is None:
            spec = {"name": "dot", "scale": scale}
            context = self.client.create_context(
                heads, head_dim, geometry=spec, value_dim=value_dim, layers=len(self.layers)
            )
            self.context_id, self.shape = context["id"], shape
        elif shape != self.shape:
            raise ValueError(
                f"every layer of a document has the same (heads, head_dim, value_dim, scale): "
                f"{self.shape}, but layer {layer} has {shape}"
            )
        return DocumentLayer(self, layer)

    def stage(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Stage a layer's spilled tokens; commit every layer's oldest staged block once each
        layer has one."""
        # Copies: the caller may write the tensors it passed again (a `MemoryLayer` does).
        staged = [t.detach().to("cpu", torch.float32, copy=True) for t in (keys, values)]
        self.staged[layer].append(tuple(staged))
        while all(self.staged[layer] for layer in self.layers):
            blocks = [self.staged[layer].pop(0) for layer in self.layers]
            tokens = {block[0].shape[1] for block in blocks}
            if len(tokens) != 1:
                raise ValueError(f"the layers spilled different token counts: {sorted(tokens)}")
            keys = torch.cat([block[0] for block in blocks])
            values = torch.cat([block[1] for block in blocks])
            self.committed = self.client.upload(self.context_id, keys, values)["n_tokens"]

    def attend(self, layer: int, queries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s attention over its committed and staged tokens."""
        parts = []
        if self.committed:
            position = self.layers.index(layer)
            found = self.client.attend(self.context_id, queries, layer=position, **self.options)
            parts.append((found.out.to(queries.device), found.lse.to(queries.device)))
        for keys, values in self.staged[layer]:
            keys, values = keys.to(queries.device), values.to(queries.device)
            parts.append(exact_part(queries, keys, values, self.shape[3]))
        return merge_attention(*parts)

    def audit_report(self, layer: int) -> list[dict]:
        """The heads of layer `layer` in the audit of the replica that answers
        (`context_audit`). ValueError when the service does not audit or the document holds
        nothing yet."""
        if self.context_id is None:
            raise ValueError("the document holds nothing yet: nothing was audited")
        heads, position = self.shape[0], self.layers.index(layer)
        audit = context_audit(self.client, self.context_id)
        return audit[position * heads : (position + 1) * heads]

    def close(self) -> None:
        """Delete the document (once) and forget what is staged."""
        if self.context_id is not None:
            self.client.delete_context(self.context_id)
        self.context_id, self.shape, self.committed = None, None, 0
        self.made.clear()
        for blocks in self.staged.values():
            blocks.clear()


class DocumentLayer:
    """One layer's view of a `RemoteDocument`, with the interface of `AttentionMemory`."""

    def __init__(self, document: RemoteDocument, layer: int) -> None:
        self.document, self.layer = document, layer

    @property
    def n_tokens(self) -> int:
        staged = sum(keys.shape[1] for keys, _ in self.document.staged[self.layer])
        return self.document.committed + staged

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.document.stage(self.layer, keys, values)

    def attend(self, queries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.document.attend(self.layer, queries)

    def audit_report(self) -> list[dict]:
        return self.document.audit_report(self.layer)

    def close(self) -> None:
        self.document.close()
