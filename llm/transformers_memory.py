"""rewa as the long-context memory of a Hugging Face transformers model (docs/llm.md).

`RewaCache` is a transformers `Cache`. Each chosen layer keeps, per sequence of the batch
(padding left out), the first `sinks` tokens and the most recent ones (at least `window`) with
the model, and moves older tokens, `spill` or more at a time, into an attention memory: a
`LocalMemory` in the process or a `RemoteMemory` on a rewa service, made per layer and
sequence by the cache's memory factory. The attention implementation `"rewa"`
(`enable(model)` registers it and switches the model to it) computes each query's attention as
two parts, the local keys exactly (causal) and the memory (`memory.attend`), and merges them by
their log-sum-exps (`merge_attention`, docs/mathematics.md 7): with an exact memory the result
is full attention; with a tail memory it is full attention with the far past estimated.

Queries of a long prompt are taken `spill` at a time, and before each block the keys that left
every query's window are spilled, so the local part stays bounded by `sinks + window + 2 spill`
keys whatever the prompt's length. Grouped-query heads are folded into the memory's queries:
kv head h is asked with the queries of its whole group. Keys are stored as the model computes
them (after rotary embeddings), so the memory needs no positions.

How the attention function finds its layer's memory: the model calls `cache.update` and then
the attention function, in the same layer and thread; `update` leaves the layer in a context
variable that the attention function takes (and clears), and an update that finds it still
there knows the model's attention is not rewa's. A layer the cache holds without memory (a
chosen subset of layers) attends its cached keys exactly; a sliding-window layer keeps only its
window (transformers' `DynamicSlidingWindowLayer`) and attends it exactly, and learned sinks
(gpt-oss) join every layer's softmax (docs/llm.md, "Models").

`EncoderMemory` does the same for a bidirectional encoder (BERT, MiniLM) reading a document
window by window: each window attends itself and the memory of the earlier windows, layer by
layer, and then joins that memory."""

from __future__ import annotations

import functools
import os
import weakref
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Protocol

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.cache_utils import Cache, DynamicLayer, DynamicSlidingWindowLayer
from transformers.masking_utils import (
    AttentionMaskInterface,
    bidirectional_mask_function,
    causal_mask_function,
)

from rewa.attention import merge_attention
from rewa.clients import RemoteMemory
from rewa.index import LocalMemory
from rewa.index.growth import appended

from .document import RemoteDocument
from .exact import exact_part

ATTENTION_NAME = "rewa"
DEFAULT_WINDOW = 512
DEFAULT_SINKS = 4
DEFAULT_SPILL = 256
# Queries of a prompt attended together by a layer with no memory (a sliding window, or a model
# without a `RewaCache` that has a window or sinks): their logits, not all the prompt's at once.
QUERY_BLOCK = 1024
# Arguments of transformers' attention functions that change the attention itself, and what they
# are: rewa computes softmax(scale <q, k>) only.
UNSUPPORTED = {"softcap": "no logit soft-capping", "position_bias": "no position bias"}
_MISMATCH = (
    "layer {layer} of the model attends {attends}, which its RewaCache layer does not hold: "
    "make the cache from the model's own config"
)


class AttentionMemory(Protocol):
    """What a layer's memory does: `rewa.index.LocalMemory` (in process) and
    `rewa.clients.RemoteMemory` (over HTTP) both are one. `append` takes the tokens it is
    given by value (copies or sends them): the layer writes those rows again afterwards."""

    @property
    def n_tokens(self) -> int: ...

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None: ...

    def attend(self, queries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def wait_for_index(self) -> None: ...

    def audit_report(self) -> list[dict]: ...

    def close(self) -> None: ...


# (layer index, kv heads, head_dim, value_dim, logit scale) -> the layer's memory, whose logits
# must be `scale * <q, k>` (the dot geometry with that scale).
MemoryFactory = Callable[[int, int, int, int, float], AttentionMemory]
# A block's grouped queries and the memory's answer for them: None (nothing spilled yet), a
# remote memory's request under way, or `(out, lse)` (`MemoryLayer._ask_memory`).
MemoryPart = Future | tuple[torch.Tensor, torch.Tensor] | None
MemoryAnswer = tuple[torch.Tensor, MemoryPart]
# Remote memories' attends in flight at once: a batch's sequences of one layer (one each).
REQUEST_THREADS = 32

_CURRENT: ContextVar[Any] = ContextVar("rewa_cache_layer", default=None)
# The padding of the forward pass under way, `(batch, positions so far)` True where a token is
# one (None: none is padding); `rewa_mask` sets it, the cache's layers and the attention read it.
_PADDING: ContextVar[torch.Tensor | None] = ContextVar("rewa_padding", default=None)
_ENCODER: ContextVar[EncoderMemory | None] = ContextVar("rewa_encoder_memory", default=None)


class MemoryLayer(DynamicLayer):
    """One sequence's cache in one layer (a `SequencesLayer` holds one per sequence, and answers
    transformers' `Cache` for them): sinks and recent tokens in `keys`/`values`
    `(1, kv_heads, n_local, head_dim)`, older ones in `memory` (created at the first spill).
    Token positions: the sinks are `[0, sinks)`, the memory holds `[sinks, sinks + n_spilled)`,
    the recent tokens follow."""

    def __init__(
        self, layer_idx: int, memory_factory: MemoryFactory, *, window: int, sinks: int, spill: int
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.memory_factory = memory_factory
        self.window, self.sinks, self.spill = window, sinks, spill
        self.memory: AttentionMemory | None = None
        self.n_seen = 0
        self.n_spilled = 0
        # The local tokens are the first rows of buffers with spare capacity (`keys` and
        # `values` are views of them), so that a decode step's token is written once, not the
        # whole window copied into a new tensor as `DynamicLayer.update` does.
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if key_states.shape[0] != 1:
            raise ValueError(
                f"rewa memory holds one sequence: batch size 1, got {key_states.shape[0]}"
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self._key_buffer = key_states.new_empty(key_states.shape[1], 0, key_states.shape[3])
            self._value_buffer = value_states.new_empty(
                value_states.shape[1], 0, value_states.shape[3]
            )
            self._set_local(0)
        n_local = self.keys.shape[-2]
        # A prompt passes through whole and is spilled at the next attend (`_without`): no
        # room to spare beyond it.
        self._key_buffer = appended(self._key_buffer, n_local, key_states[0], spare=False)
        self._value_buffer = appended(self._value_buffer, n_local, value_states[0], spare=False)
        self._set_local(n_local + key_states.shape[-2])
        self.n_seen += key_states.shape[-2]
        return self.keys, self.values

    def _set_local(self, n_local: int) -> None:
        """The first `n_local` rows of the buffers as `keys` and `values`."""
        self.keys = self._key_buffer[:, :n_local].unsqueeze(0)
        self.values = self._value_buffer[:, :n_local].unsqueeze(0)

    def local_positions(self) -> torch.Tensor:
        """The sequence position of each local key."""
        sinks = min(self.sinks, self.n_seen)
        recent = torch.arange(self.sinks + self.n_spilled, self.n_seen)
        return torch.cat([torch.arange(sinks), recent]).to(self.keys.device)

    def attend(
        self,
        query: torch.Tensor,
        scaling: float,
        sinks: torch.Tensor | None = None,
        asked: MemoryAnswer | None = None,
    ) -> torch.Tensor:
        """Attention of the newest `m` tokens' queries `(1, q_heads, m, head_dim)` over every
        token so far: `(1, m, q_heads, value_dim)` in the query's dtype. `sinks` `(q_heads,)`:
        a logit per query head that takes part in the softmax with no value (`_sink_part`).
        `asked`: what `ask` returned for these queries (their memory part already under way)."""
        _, q_heads, m, _ = query.shape
        group = self._group(q_heads)
        first = self.n_seen - m
        outs = []
        for start in range(first, self.n_seen, self.spill):
            end = min(start + self.spill, self.n_seen)
            block = query[0, :, start - first : end - first]
            if asked is None:
                self._spill_before(start, scaling)
                grouped, memory_part = self._ask_memory(block, group)
            else:
                grouped, memory_part = asked
            # The local part is computed while a remote memory's answer is on its way.
            parts = [self._local_attention(grouped, start, end, scaling)]
            if memory_part is not None:
                parts.append(_memory_answer(memory_part, grouped.device))
            if sinks is not None:
                parts.append(_sink_part(sinks, parts[0][0], group))
            out, _ = merge_attention(*parts)
            outs.append(out.reshape(q_heads, end - start, -1))
        return torch.cat(outs, dim=1).transpose(0, 1).unsqueeze(0).to(query.dtype)

    def ask(self, query: torch.Tensor, scaling: float) -> MemoryAnswer | None:
        """Start the memory part of `attend(query, ...)` for queries of at most `spill` tokens
        (one block: a decode step): spill what is due and ask the memory, on a request thread
        when it is remote (`_ask_memory`); `attend(..., asked=)` takes the answer. None for
        more tokens, whose blocks spill between them (`attend` asks for each in turn)."""
        _, q_heads, m, _ = query.shape
        if m > self.spill:
            return None
        self._spill_before(self.n_seen - m, scaling)
        return self._ask_memory(query[0], self._group(q_heads))

    def _group(self, q_heads: int) -> int:
        """Query heads per key/value head."""
        kv_heads = self.keys.shape[1]
        if q_heads % kv_heads:
            raise ValueError(f"{q_heads} query heads do not share {kv_heads} key/value heads")
        return q_heads // kv_heads

    def _ask_memory(self, block: torch.Tensor, group: int) -> MemoryAnswer:
        """A block's queries `(q_heads, n, head_dim)` grouped by key/value head (kv head h
        answers query heads h * group ... (h + 1) * group - 1), and the memory's answer for
        them: None before the first spill, a `Future` for a `RemoteMemory` (its request runs on
        `_requests()`; nothing else of the layer does), else `(out, lse)`."""
        kv_heads, n, head_dim = self.keys.shape[1], block.shape[1], block.shape[2]
        grouped = block.float().reshape(kv_heads, group * n, head_dim)
        if not self.n_spilled:
            return grouped, None
        if isinstance(self.memory, RemoteMemory):
            return grouped, _requests().submit(self.memory.attend, grouped)
        return grouped, self.memory.attend(grouped)

    def _local_attention(self, grouped, start, end, scaling):
        """Exact causal attention of grouped queries, those of the tokens `[start, end)` of each
        group, over the local keys before `end`."""
        if start == self.n_seen - 1:
            # The newest token's queries (a decode step) see every local key: no mask.
            return exact_part(grouped, self.keys[0], self.values[0], scaling)
        group = grouped.shape[1] // (end - start)
        positions = torch.arange(start, end, device=grouped.device).repeat(group)
        key_positions = self.local_positions()
        visible = int((key_positions < end).sum())
        seen = key_positions[:visible].unsqueeze(0) <= positions.unsqueeze(1)
        keys, values = self.keys[0, :, :visible], self.values[0, :, :visible]
        return exact_part(grouped, keys, values, scaling, seen)

    def _spill_before(self, position: int, scaling: float) -> None:
        """Move the recent tokens before `position - window` (none of the queries from
        `position` on has them in its window) into the memory, once `spill` of them wait."""
        start = self.sinks + self.n_spilled
        count = position - self.window - start
        if count < self.spill:
            return
        if self.memory is None:
            _, kv_heads, _, head_dim = self.keys.shape
            value_dim = self.values.shape[-1]
            self.memory = self.memory_factory(
                self.layer_idx, kv_heads, head_dim, value_dim, scaling
            )
        moved = slice(self.sinks, self.sinks + count)
        self.memory.append(self.keys[0, :, moved], self.values[0, :, moved])
        n_local = self.keys.shape[-2]
        self._key_buffer = _without(self._key_buffer, moved, n_local, self.spill)
        self._value_buffer = _without(self._value_buffer, moved, n_local, self.spill)
        self._set_local(n_local - count)
        self.n_spilled += count

    def wait_for_index(self) -> None:
        """Wait until the memory has indexed what it holds (`wait_for_index` of the memory;
        nothing while none was made)."""
        if self.memory is not None:
            self.memory.wait_for_index()

    def close(self) -> None:
        """Free the memory (a remote one it created is deleted) and forget every token."""
        if self.memory is not None:
            self.memory.close()
        self.memory = None
        self.keys = self.values = None
        self._key_buffer = self._value_buffer = None
        self.is_initialized = False
        self.n_seen = self.n_spilled = 0


@functools.cache
def _requests() -> ThreadPoolExecutor:
    """The threads that send remote memories' attends, so that the sequences of a batch wait
    for their answers together and a layer computes its local part meanwhile. They run the
    client's HTTP request only, no PyTorch operation of the model's size (two threads' PyTorch
    thread pools slow each other down: docs/benchmark-notes.md, "Two threads running
    PyTorch"). A forked child makes its own (the parent's threads do not exist in it)."""
    return ThreadPoolExecutor(REQUEST_THREADS, thread_name_prefix="rewa-memory-request")


os.register_at_fork(after_in_child=_requests.cache_clear)


def _memory_answer(part: MemoryPart, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """`(out, lse)` of a memory part (`MemoryPart`, not None) on `device`."""
    out, lse = part.result() if isinstance(part, Future) else part
    return out.to(device), lse.to(device)


def _sink_part(
    sinks: torch.Tensor, like: torch.Tensor, group: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Learned attention sinks (gpt-oss's `s_aux`, a logit per query head that joins the
    softmax and carries no value) as one more `(out, lse)` part to merge: zeros, and the sink
    logit of each grouped query row of `like` `(kv_heads, group * m, dv)`, whose rows are the
    `m` queries of query head `h * group + g` at `g * m` (`MemoryLayer.attend`)."""
    kv_heads, rows = like.shape[0], like.shape[1]
    logits = sinks.detach().to(like.device, torch.float32).reshape(kv_heads, group, 1)
    lse = logits.expand(kv_heads, group, rows // group).reshape(kv_heads, rows)
    return torch.zeros_like(like), lse


def _without(buffer: torch.Tensor, moved: slice, used: int, spare: int) -> torch.Tensor:
    """`buffer` `(heads, capacity, d)` with its rows `moved` taken out of its first `used`: the
    rows after them moved down (a copy first: the two ranges overlap), in place, or into a
    buffer of `spare` rows to spare where `buffer` is more than twice that size (after a long
    prompt, which passed through it whole)."""
    rows = used - (moved.stop - moved.start)
    if buffer.shape[1] > 2 * (rows + spare):
        smaller = buffer.new_empty(buffer.shape[0], rows + spare, buffer.shape[2])
        smaller[:, : moved.start] = buffer[:, : moved.start]
        smaller[:, moved.start : rows] = buffer[:, moved.stop : used]
        return smaller
    buffer[:, moved.start : rows] = buffer[:, moved.stop : used].clone()
    return buffer


def _token_mask(batch: int, positions: int, device: torch.device) -> torch.Tensor | None:
    """Which of the last `positions` positions hold tokens, per sequence `(batch, positions)`,
    from the padding of the forward pass under way (`_PADDING`); None where none is padding."""
    padding = _PADDING.get()
    if padding is None:
        return None
    if padding.shape[0] != batch or padding.shape[1] < positions:
        raise ValueError(
            f"the attention mask {tuple(padding.shape)} does not cover {batch} sequences of "
            f"{positions} positions: pass the 2D attention mask of the whole sequence so far"
        )
    return padding[:, padding.shape[1] - positions :].to(device)


class SequencesLayer(DynamicLayer):
    """One memory layer of a batch: a `MemoryLayer` per sequence (`sequences`, made at the first
    update), each holding its sequence's tokens without the padding (`_PADDING`), so that a
    sequence's sinks, window and memory are its own tokens. Positions count padding as
    transformers' caches do (`get_seq_length`)."""

    is_croppable = False

    def __init__(
        self, layer_idx: int, memory_factory: MemoryFactory, *, window: int, sinks: int, spill: int
    ) -> None:
        super().__init__()
        self.new_sequence = functools.partial(
            MemoryLayer, layer_idx, memory_factory, window=window, sinks=sinks, spill=spill
        )
        self.sequences: list[MemoryLayer] = []
        self.n_positions = 0
        self._tokens: torch.Tensor | None = None  # the latest update's (batch, m), None: all

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        batch, m = key_states.shape[0], key_states.shape[-2]
        if not self.sequences:
            self.sequences = [self.new_sequence() for _ in range(batch)]
            self.is_initialized = True
        if batch != len(self.sequences):
            raise ValueError(
                f"a batch of {batch} sequences, where this cache holds {len(self.sequences)}"
            )
        self._tokens = _token_mask(batch, m, key_states.device)
        for b, sequence in enumerate(self.sequences):
            keys, values = key_states[b : b + 1], value_states[b : b + 1]
            if self._tokens is not None:
                keys, values = keys[:, :, self._tokens[b]], values[:, :, self._tokens[b]]
            sequence.update(keys, values)
        self.n_positions += m
        # What `Cache` reads of a layer (dtype, device, shape): not the block, which a long
        # prompt makes large.
        self.keys = key_states.new_empty(*key_states.shape[:2], 0, key_states.shape[-1])
        self.values = value_states.new_empty(*value_states.shape[:2], 0, value_states.shape[-1])
        return key_states, value_states

    def attend(
        self, query: torch.Tensor, scaling: float, sinks: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`MemoryLayer.attend` of each sequence's queries: `(batch, m, q_heads, value_dim)`,
        zeros at padding."""
        if self._tokens is None and len(self.sequences) == 1:
            return self.sequences[0].attend(query, scaling, sinks)
        tokens = [
            slice(None) if self._tokens is None else self._tokens[b]
            for b in range(len(self.sequences))
        ]
        queries = [query[b : b + 1, :, tokens[b]] for b in range(len(self.sequences))]
        # Every sequence's memory is asked before any answer is awaited: remote memories'
        # requests are then in flight together, not one round trip after another.
        asked = [
            sequence.ask(sequence_queries, scaling) if sequence_queries.shape[-2] else None
            for sequence, sequence_queries in zip(self.sequences, queries, strict=True)
        ]
        out = None
        for b, sequence in enumerate(self.sequences):
            if queries[b].shape[-2] == 0:
                continue
            answer = sequence.attend(queries[b], scaling, sinks, asked[b])[0]
            if out is None:
                shape = (query.shape[0], query.shape[2], query.shape[1], answer.shape[-1])
                out = answer.new_zeros(shape)
            out[b, tokens[b]] = answer
        if out is None:  # nothing but padding
            value_dim = self.sequences[0].values.shape[-1]
            return query.new_zeros(query.shape[0], query.shape[2], query.shape[1], value_dim)
        return out

    def get_seq_length(self) -> int:
        return self.n_positions

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.n_positions + query_length, 0

    def wait_for_index(self) -> None:
        for sequence in self.sequences:
            sequence.wait_for_index()

    def close(self) -> None:
        for sequence in self.sequences:
            sequence.close()
        self.sequences = []
        self.keys = self.values = None
        self.is_initialized = False
        self.n_positions = 0

    def reset(self) -> None:
        self.close()

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError("a rewa memory layer cannot be cropped (tokens in memory stay there)")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise ValueError("a rewa memory is one per sequence: beam search is not supported")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.sequences:
            raise ValueError("a rewa memory is one per sequence: its batch cannot be expanded")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise ValueError("a rewa memory is one per sequence: its batch cannot be changed")


def _sliding_windows(config: Any) -> list[int | None]:
    """Per layer of the model's decoder, the sliding window it attends (None: every token), as
    transformers' own caches read them: the config's `layer_types`, else its `sliding_window`
    for every layer; any other kind of layer (chunked, linear, recurrent) is refused."""
    decoder = config.get_text_config(decoder=True)
    n_layers = decoder.num_hidden_layers
    window = getattr(decoder, "sliding_window", None)
    types = getattr(decoder, "layer_types", None)
    if types is None:
        chunked = getattr(decoder, "attention_chunk_size", None) is not None
        kind = "chunked_attention" if chunked else "full_attention"
        types = ["sliding_attention" if window is not None else kind] * n_layers
    windows = []
    for i, kind in enumerate(types[:n_layers]):
        if kind not in ("full_attention", "sliding_attention"):
            raise ValueError(
                f"layer {i} is {kind!r}: a RewaCache holds full and sliding-window attention "
                "layers only"
            )
        windows.append(window if kind == "sliding_attention" else None)
    return windows


class RewaCache(Cache):
    """The cache of a model whose attention implementation is `"rewa"` (`enable`): the layers in
    `layers` (default: every full-attention layer) keep, per sequence of the batch, `sinks` and
    at least `window` recent tokens and spill older ones into a memory made by
    `memory(layer, kv_heads, head_dim, value_dim, scale)` (`local_memories`, `remote_memories`;
    `SequencesLayer`); sliding-window layers keep their window, other layers every token.
    `close()` (or leaving a `with` block) frees every layer's memory."""

    def __init__(
        self,
        config: Any,
        memory: MemoryFactory,
        *,
        window: int = DEFAULT_WINDOW,
        sinks: int = DEFAULT_SINKS,
        spill: int = DEFAULT_SPILL,
        layers: Iterable[int] | None = None,
    ) -> None:
        if window < 0 or sinks < 0 or spill < 1:
            raise ValueError(
                f"expected window >= 0, sinks >= 0 and spill >= 1, got {window}, {sinks}, {spill}"
            )
        windows = _sliding_windows(config)
        n_layers = len(windows)
        full = {i for i, sliding in enumerate(windows) if sliding is None}
        chosen = full if layers is None else set(layers)
        outside = sorted(chosen - set(range(n_layers)))
        if outside:
            raise ValueError(f"layers {outside} are not among the model's {n_layers} layers")
        sliding = sorted(chosen - full)
        if sliding:
            raise ValueError(
                f"layers {sliding} attend a sliding window: they keep only it, with no memory"
            )
        document = getattr(memory, "__self__", None)
        if isinstance(document, RemoteDocument) and set(document.layers) != chosen:
            raise ValueError(
                f"the document holds layers {document.layers} and the cache spills layers "
                f"{sorted(chosen)}: a document commits a spill once each of its layers made it, "
                "so they must be the same"
            )
        super().__init__(
            layers=[
                DynamicSlidingWindowLayer(sliding_window=windows[i])
                if windows[i] is not None
                else SequencesLayer(i, memory, window=window, sinks=sinks, spill=spill)
                if i in chosen
                else DynamicLayer()
                for i in range(n_layers)
            ]
        )

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        pending = _CURRENT.get()
        _CURRENT.set(None)
        if pending is not None and any(pending is layer for layer in self.layers):
            raise ValueError(
                "the model did not call rewa attention after its cache's update: switch it "
                "with rewa.llm.enable(model) first (RewaCache holds tokens it never shows the "
                "model's own attention)"
            )
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        _CURRENT.set(self.layers[layer_idx])
        return keys, values

    @property
    def memory_layers(self) -> list[MemoryLayer]:
        """Every sequence's `MemoryLayer`, layer by layer (none before the first update)."""
        return [sequence for layer in self._sequences() for sequence in layer.sequences]

    def _sequences(self) -> list[SequencesLayer]:
        return [layer for layer in self.layers if isinstance(layer, SequencesLayer)]

    def wait_for_index(self) -> None:
        """Wait until every layer's memory has indexed what it holds: after a long prompt, so
        that the decode steps that follow read indexes, not the keys still being indexed
        (docs/llm.md, "Waiting for the index")."""
        for layer in self._sequences():
            layer.wait_for_index()

    def close(self) -> None:
        for layer in self._sequences():
            layer.close()

    def __enter__(self) -> RewaCache:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


class EncoderMemory:
    """A bidirectional encoder (BERT, MiniLM) reading a long document window by window, with a
    memory per layer: inside `with memory.reading():`, each attention layer of the model (its
    attention implementation `"rewa"`, `enable`) attends the window's own keys (all of them,
    no mask) and the layer's memory of every earlier window, merged by log-sum-exp; then the
    window's keys and values join that memory. With exact memories a window's hidden states are
    those of attention over all the tokens read so far (block-causal over windows).
    Layers outside `layers` (default: all) attend their window only. `close()` frees the
    memories. A layer is its attention module's `layer_idx`, or where the modules carry none
    (DistilBERT) its rank among the modules in the order they first attend (`layer_of`)."""

    def __init__(self, memory: MemoryFactory, *, layers: Iterable[int] | None = None) -> None:
        self.memory_factory = memory
        self.layers = None if layers is None else set(layers)
        self.memories: dict[int, AttentionMemory] = {}
        self._unnamed: weakref.WeakKeyDictionary[torch.nn.Module, int] = weakref.WeakKeyDictionary()

    def layer_of(self, module: torch.nn.Module) -> int:
        """The layer whose memory `module` reads: its `layer_idx`, else the order in which the
        modules without one first attended (a model's forward pass calls them layer by
        layer)."""
        layer_idx = getattr(module, "layer_idx", None)
        if layer_idx is not None:
            return layer_idx
        if module not in self._unnamed:
            self._unnamed[module] = len(self._unnamed)
        return self._unnamed[module]

    @contextmanager
    def reading(self) -> Iterator[EncoderMemory]:
        token = _ENCODER.set(self)
        try:
            yield self
        finally:
            _ENCODER.reset(token)

    def attend(self, layer_idx, query, key, value, scaling: float) -> torch.Tensor:
        """The window's attention at layer `layer_idx`: `(1, m, heads, dv)`."""
        if query.shape[0] != 1:
            raise ValueError(f"rewa memory reads one sequence: batch size 1, got {query.shape[0]}")
        if self.layers is not None and layer_idx not in self.layers:
            return _exact(query, key, value, scaling, causal=False)
        kv_heads, head_dim = key.shape[1], key.shape[-1]
        group = query.shape[1] // kv_heads
        grouped = query[0].float().reshape(kv_heads, group * query.shape[2], head_dim)
        keys, values = key[0].float(), value[0].float()
        parts = [exact_part(grouped, keys, values, scaling)]
        memory = self.memories.get(layer_idx)
        if memory is not None:
            out, lse = memory.attend(grouped)
            parts.append((out.to(grouped.device), lse.to(grouped.device)))
        else:
            memory = self.memory_factory(layer_idx, kv_heads, head_dim, values.shape[-1], scaling)
            self.memories[layer_idx] = memory
        out, _ = merge_attention(*parts)
        memory.append(keys, values)
        out = out.reshape(query.shape[1], query.shape[2], -1)
        return out.transpose(0, 1).unsqueeze(0).to(query.dtype)

    def close(self) -> None:
        for memory in self.memories.values():
            memory.close()
        self.memories.clear()

    def __enter__(self) -> EncoderMemory:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


def rewa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The `"rewa"` attention implementation: query `(batch, q_heads, m, d)`, the cache's keys
    and values `(batch, kv_heads, n, d)`; returns `((batch, m, q_heads, dv), None)`. A layer
    with a `sliding_window` attends that many latest positions exactly; `s_aux` (gpt-oss) are
    sinks (`_sink_part`); what it cannot compute (logit soft-capping, a position bias) is
    refused."""
    layer = _CURRENT.get()
    _CURRENT.set(None)
    if attention_mask is not None:
        raise ValueError("rewa attention takes a 2D attention mask only (not a prepared 4D one)")
    if dropout:
        raise ValueError("rewa attention is for inference: call model.eval() (no dropout)")
    for name, what in UNSUPPORTED.items():
        if kwargs.get(name) is not None:
            raise ValueError(f"rewa attention computes plain softmax attention: {what} ({name})")
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    window, sinks = kwargs.get("sliding_window"), kwargs.get("s_aux")
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else causal
    layer_idx = getattr(module, "layer_idx", None)
    if isinstance(layer, SequencesLayer):
        if window is not None or not causal:
            attends = "bidirectionally" if window is None else f"a window of {window}"
            raise ValueError(_MISMATCH.format(layer=layer_idx, attends=attends))
        cached = (layer.keys.shape[1], layer.keys.shape[-1], layer.values.shape[-1])
        if cached != (key.shape[1], key.shape[-1], value.shape[-1]):
            raise ValueError(
                f"layer {layer_idx} caches something else than the keys and values it attends "
                f"(heads, key and value widths {cached} against {key.shape[1]}, "
                f"{key.shape[-1]}, {value.shape[-1]}; DeepSeek's compressed latents): a rewa "
                "memory holds keys and values"
            )
        return layer.attend(query, scaling, sinks), None
    if isinstance(layer, DynamicSlidingWindowLayer) and window != layer.sliding_window:
        attends = "every token" if window is None else f"a window of {window}"
        raise ValueError(_MISMATCH.format(layer=layer_idx, attends=attends))
    encoder = _ENCODER.get()
    if encoder is not None:
        if window is not None or sinks is not None or _PADDING.get() is not None:
            raise ValueError(
                "an encoder memory reads one unpadded window with full attention: no padding, "
                "sliding window or sinks"
            )
        return encoder.attend(encoder.layer_of(module), query, key, value, scaling), None
    return _exact(query, key, value, scaling, causal, window, sinks), None


def _exact(query, key, value, scaling, causal: bool, window=None, sinks=None):
    """Full attention of queries `(batch, q_heads, m, d)` over keys `(batch, kv_heads, n, d)`
    (causal: the queries are the last `m` of the `n` keys' positions; `window`: a query sees
    only that many latest positions, its own included; `sinks`: `_sink_part`), padding
    (`_PADDING`) unseen: `(batch, m, q_heads, dv)`."""
    if window is not None and not causal:
        raise ValueError("rewa attention supports causal sliding windows only")
    tokens = _token_mask(key.shape[0], key.shape[-2], key.device)
    if window is None and sinks is None and tokens is None:
        group = query.shape[1] // key.shape[1]
        key = key.repeat_interleave(group, dim=1)
        value = value.repeat_interleave(group, dim=1)
        m, n = query.shape[-2], key.shape[-2]
        allowed = torch.ones(m, n, dtype=torch.bool, device=query.device)
        allowed = allowed.tril(n - m) if causal else allowed
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=allowed, scale=scaling
        )
        return out.transpose(1, 2)
    per_sequence = [None] * query.shape[0] if tokens is None else tokens
    rows = [
        _exact_blocks(q, k, v, scaling, causal, window, sinks, t)
        for q, k, v, t in zip(query, key, value, per_sequence, strict=True)
    ]
    return torch.stack(rows).to(query.dtype)


def _exact_blocks(query, keys, values, scaling, causal: bool, window, sinks, tokens):
    """`_exact` of one sequence (query `(q_heads, m, d)`, keys and values `(kv_heads, n, .)`,
    `tokens` `(n,)` which keys are tokens, None: all), `QUERY_BLOCK` queries at a time, each
    over the keys it can see (with a window, at most `window + QUERY_BLOCK` of them):
    `(m, q_heads, dv)`, zeros where a query sees no token."""
    q_heads, m, head_dim = query.shape
    kv_heads, n = keys.shape[0], keys.shape[1]
    group = q_heads // kv_heads
    key_positions = torch.arange(n, device=query.device)
    outs = []
    for start in range(0, m, QUERY_BLOCK):
        end = min(start + QUERY_BLOCK, m)
        block = query[:, start:end].float().reshape(kv_heads, group * (end - start), head_dim)
        low, high, visible = 0, n, None
        if causal:  # the block's queries are at positions [first, high)
            first, high = n - m + start, n - m + end
            low = 0 if window is None else max(0, first - window + 1)
            positions = torch.arange(first, high, device=query.device).unsqueeze(1)
            seen = key_positions[low:high].unsqueeze(0)
            visible = seen <= positions
            if window is not None:
                visible &= seen > positions - window
        if tokens is not None:
            real = tokens[low:high].unsqueeze(0)
            visible = real if visible is None else visible & real
        if visible is not None:
            visible = visible.expand(end - start, -1).repeat(group, 1)
        parts = [exact_part(block, keys[:, low:high], values[:, low:high], scaling, visible)]
        if sinks is not None:
            parts.append(_sink_part(sinks, parts[0][0], group))
        out, _ = merge_attention(*parts)
        outs.append(out.reshape(q_heads, end - start, -1))
    return torch.cat(outs, dim=1).transpose(0, 1)


def rewa_mask(
    batch_size: int,
    *args: Any,
    mask_function: Callable = causal_mask_function,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> None:
    """The mask of the `"rewa"` implementation: none (it masks causally itself where the
    attention module is causal, within its sliding window where it has one), after checking
    that the model asks for nothing else: causal attention (with or without a sliding window)
    or bidirectional attention. The padding of `attention_mask` is left in `_PADDING` for the
    cache's layers and the attention of this forward pass."""
    if mask_function not in (causal_mask_function, bidirectional_mask_function):
        first = int(kwargs.get("q_offset") or 0)
        queries = torch.arange(first, first + int(kwargs.get("q_length") or 0))
        window = kwargs.get("local_size")
        if not _is_sliding_window(mask_function, window, batch_size, queries):
            raise ValueError(
                "rewa attention supports causal attention, with or without a sliding window, and "
                "bidirectional attention only (no chunked, packed or bidirectional sliding masks)"
            )
    padded = attention_mask is not None and not bool(attention_mask.all())
    _PADDING.set(attention_mask.bool() if padded else None)
    return None


def _is_sliding_window(
    mask_function: Callable, window: int | None, batch_size: int, queries: torch.Tensor
) -> bool:
    """Whether `mask_function` is transformers' causal sliding-window mask of `window`
    positions (a query at p sees the keys in (p - window, p]), from its answers:
    - for keys around the window's edges and a query far from the start (a chunked mask of the
      same size answers otherwise for the key just before a query that starts a chunk);
    - for every query of the forward pass (`queries`, their positions), in every sequence, for
      its own key, the first of its window and the next one (a mask of packed sequences
      answers otherwise at a sequence's first token, which sees no key before it, and a mask
      that lets blocks of tokens see each other, such as images', within such a block)."""
    if window is None or window < 1:
        return False
    far = 3 * window
    offsets = (-2 * window, -window - 1, -window, -window + 1, -1, 0, 1)
    zero, rows = torch.tensor(0), torch.arange(batch_size).unsqueeze(1)
    queries = queries.unsqueeze(0)
    try:
        seen = [
            bool(mask_function(zero, zero, torch.tensor(far), torch.tensor(far + offset)))
            for offset in offsets
        ]
        own = mask_function(rows, zero, queries, queries)
        first = mask_function(rows, zero, queries, (queries - window + 1).clamp_min(0))
        later = mask_function(rows, zero, queries, queries + 1)
    except (IndexError, RuntimeError):  # a mask over a table (packed sequences) short of them
        return False
    edges = seen == [-window < offset <= 0 for offset in offsets]
    seen_as_window = torch.as_tensor(own).all() & torch.as_tensor(first).all()
    return edges and bool(seen_as_window & ~torch.as_tensor(later).any())


def register() -> None:
    """Make `"rewa"` an attention implementation transformers knows (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, rewa_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, rewa_mask)


def enable(model: PreTrainedModel) -> PreTrainedModel:
    """Register the `"rewa"` attention and switch `model` to it; returns the model."""
    register()
    model.set_attn_implementation(ATTENTION_NAME)
    if model.config._attn_implementation != ATTENTION_NAME:
        raise ValueError(
            f"{type(model).__name__} does not take its attention from transformers' "
            "AttentionInterface, so rewa cannot be its attention"
        )
    return model


def local_memories(**options: Any) -> MemoryFactory:
    """A memory factory of in-process `LocalMemory`s (`options`: mode, budget, top_k, device,
    open_segment...): like a context of the service, a memory reads the spills of its open
    segment exactly and extends its index once per segment of 2048 spilled tokens instead of
    once per spill (docs/llm.md, "Known limits")."""

    def make(layer: int, heads: int, head_dim: int, value_dim: int, scale: float):
        return LocalMemory(
            heads, head_dim, value_dim=value_dim, geometry="dot", scale=scale, **options
        )

    return make


def remote_memories(client: Any, **options: Any) -> MemoryFactory:
    """A memory factory of `RemoteMemory`s, one new context per layer on the service `client`
    speaks to (`options`: mode, budget, top_k...); `RewaCache.close()` deletes them."""

    def make(layer: int, heads: int, head_dim: int, value_dim: int, scale: float):
        return RemoteMemory.create(
            client,
            heads,
            head_dim,
            value_dim=value_dim,
            geometry={"name": "dot", "scale": scale},
            name=f"layer-{layer}",
            **options,
        )

    return make
