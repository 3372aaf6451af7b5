"""rewa as a language model's memory: `LocalMemory` (in process) and `RemoteMemory` (a live
`rewa serve`) behind one interface, and the transformers integration (`RewaCache`, the "rewa"
attention implementation) on a tiny Llama with grouped-query heads built from a config.

The tiny Llama's initializer range is 0.05 rather than the config's default 0.02: at 0.02 its
attention is nearly uniform, where any estimate of the far past agrees with full attention (top-K
included); at 0.05 top-K keeps only about 75 % of the argmaxes over 4k tokens, so tail's >= 99 %
says something (docs/llm.md, "Accuracy")."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rewa.attention import dense_attention, make_geometry, merge_attention
from rewa.clients import Client, RemoteMemory
from rewa.index import KeyClusters, LocalMemory, retrieval_attention
from rewa.index import memory as index_memory
from rewa.index.growth import sealed_keys
from rewa.llm import (
    EncoderMemory,
    RemoteDocument,
    RewaCache,
    enable,
    local_memories,
    remote_memories,
)
from rewa.llm.exact import SMALL_LOGITS, exact_part
from tests.llm_support import assert_generates_each_alone, left_padded
from tests.service_support import Server

TOKENS = 4096


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    running = Server(data_dir=tmp_path_factory.mktemp("data")).start()
    yield running
    running.kill()


@pytest.fixture(scope="module")
def models():
    """The same tiny Llama twice: with SDPA (the reference) and with rewa attention."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        initializer_range=0.05,
    )
    reference = LlamaForCausalLM(config).eval()
    reference.set_attn_implementation("sdpa")
    # A model keeps the config it is given, attention implementation included: its own copy.
    model = LlamaForCausalLM(copy.deepcopy(config)).eval()
    model.load_state_dict(reference.state_dict())
    return reference, enable(model)


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, 256, (1, TOKENS), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def full_logits(models, tokens):
    with torch.no_grad():
        return models[0](tokens).logits


def _logits_with(model, tokens, cache: RewaCache) -> torch.Tensor:
    with torch.no_grad():
        logits = model(tokens, past_key_values=cache, use_cache=True).logits
    assert all(layer.n_spilled > TOKENS // 2 for layer in cache.memory_layers)
    return logits


def _argmax_agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.argmax(-1) == b.argmax(-1)).float().mean().item()


# -- the memories -----------------------------------------------------------------------------


def _sequence(heads=2, n=3000, d=16, seed=5):
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(heads, n, d, generator=generator)
    values = torch.randn(heads, n, d, generator=generator)
    queries = 2 * torch.randn(heads, 7, d, generator=generator)
    return keys, values, queries


def test_an_exact_local_memory_is_dense_attention_over_every_appended_token():
    keys, values, queries = _sequence()
    memory = LocalMemory(2, 16, mode="exact")
    for start in range(0, 3000, 700):
        memory.append(keys[:, start : start + 700], values[:, start : start + 700])
    assert memory.n_tokens == 3000
    out, lse = memory.attend(queries)
    expected = dense_attention(queries, keys, values, make_geometry("dot", 16))
    torch.testing.assert_close(out, expected[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, expected[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n_keys", [300, 80000])  # one logits tensor; the tiled path
def test_the_exact_part_is_masked_dense_attention_with_empty_rows_at_zero(n_keys):
    keys, values, queries = _sequence(n=n_keys, seed=3)
    assert (2 * 7 * n_keys > SMALL_LOGITS) == (n_keys == 80000)
    visible = torch.rand(7, n_keys, generator=torch.Generator().manual_seed(4)) < 0.5
    visible[2] = False  # a query that sees no key
    queries = queries.requires_grad_()
    out, lse = exact_part(queries, keys, values, 0.3, visible)
    geometry = make_geometry("dot", 16, scale=0.3)
    expected = dense_attention(queries, keys, values, geometry, mask=visible)
    torch.testing.assert_close(out, expected[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, expected[1], rtol=1e-5, atol=1e-5)
    assert (out[:, 2] == 0).all() and torch.isneginf(lse[:, 2]).all()
    seen = torch.arange(7) != 2
    (grad,) = torch.autograd.grad((out[:, seen].sum() + lse[:, seen].sum()), queries)
    (expected_grad,) = torch.autograd.grad(
        (expected[0][:, seen].sum() + expected[1][:, seen].sum()), queries
    )
    torch.testing.assert_close(grad, expected_grad, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode", ["tail", "topk"])
def test_a_local_memory_grown_by_appends_answers_as_one_built_over_all_its_tokens(mode):
    keys, values, queries = _sequence(n=6000)
    geometry = make_geometry("dot", 16)
    # Every attend waits for the extension it starts (exact_while_building=0).
    grown = LocalMemory(2, 16, mode=mode, open_segment=500, exact_while_building=0)
    grown.append(keys[:, :2500], values[:, :2500])
    grown.attend(queries)  # builds the indexes over 2500 tokens
    for start in range(2500, 6000, 500):  # extended, and retrained at 4096
        grown.append(keys[:, start : start + 500], values[:, start : start + 500])
        out, lse = grown.attend(queries)
    for head in range(2):
        if mode == "tail":
            index = KeyClusters.build(geometry.witness(keys[head]), values[head], geometry)
            expected = retrieval_attention(
                queries[head], keys[head], values[head], geometry, index=index, tail=True
            )
        else:
            expected = retrieval_attention(
                queries[head], keys[head], values[head], geometry, top_k=64
            )
        torch.testing.assert_close(out[head], expected[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse[head], expected[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["tail", "topk"])
def test_the_open_segment_is_read_exactly_and_indexed_when_it_fills(mode):
    keys, values, queries = _sequence(n=5000)
    geometry = make_geometry("dot", 16)
    memory = LocalMemory(2, 16, mode=mode, open_segment=1000, exact_while_building=0)
    memory.append(keys[:, :2500], values[:, :2500])
    memory.attend(queries)  # the index of the first 2000 tokens
    indexes = memory._indexes
    memory.append(keys[:, 2500:2800], values[:, 2500:2800])
    memory.append(keys[:, 2800:2999], values[:, 2800:2999])
    out, lse = memory.attend(queries)  # 999 in the open segment: read exactly
    assert memory._indexes is indexes  # neither rebuilt nor extended
    options = {"tail": True} if mode == "tail" else {"top_k": 64}
    for head in range(2):
        k, v = keys[head, :2000], values[head, :2000]
        index = KeyClusters.build(geometry.witness(k), v, geometry) if mode == "tail" else "ivf"
        indexed = retrieval_attention(queries[head], k, v, geometry, index=index, **options)
        recent = dense_attention(
            queries[head], keys[head, 2000:2999], values[head, 2000:2999], geometry
        )
        expected = merge_attention(indexed, recent)
        torch.testing.assert_close(out[head], expected[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse[head], expected[1], rtol=1e-5, atol=1e-5)
    at_once = LocalMemory(2, 16, mode=mode, open_segment=1000)  # how tokens arrive: no matter
    at_once.append(keys[:, :2999], values[:, :2999])
    torch.testing.assert_close((out, lse), at_once.attend(queries), rtol=1e-5, atol=1e-5)
    memory.append(keys[:, 2999:3000], values[:, 2999:3000])  # the segment fills: indexed now
    out, lse = memory.attend(queries)
    every = LocalMemory(2, 16, mode=mode, open_segment=0)
    every.append(keys[:, :3000], values[:, :3000])
    torch.testing.assert_close((out, lse), every.attend(queries), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="open_segment"):
        LocalMemory(2, 16, open_segment=-1)


def test_a_tail_memory_extends_its_clusters_on_the_build_thread():
    """When a segment fills, the attend does not wait for the extension: it answers from the
    clusters it had and reads every later token exactly; the extended clusters answer once the
    extension ends, as a memory that indexed every token at once would; an extension that
    fails is reported by the next attend, and the one after starts it again."""
    keys, values, queries = _sequence(n=3000)
    geometry = make_geometry("dot", 16)
    memory = LocalMemory(2, 16, open_segment=1000)
    memory.append(keys[:, :2000], values[:, :2000])
    memory.attend(queries)  # the first clusters, built in the attend: 2000 tokens
    indexes = memory._indexes
    held = threading.Event()
    blocker = index_memory._builder().submit(held.wait)  # the build thread busy
    try:
        memory.append(keys[:, 2000:3000], values[:, 2000:3000])  # the segment fills
        out, lse = memory.attend(queries)
        assert memory._indexes is indexes and memory._extension is not None
        for head in range(2):
            k, v = keys[head, :2000], values[head, :2000]
            index = KeyClusters.build(geometry.witness(k), v, geometry)
            indexed = retrieval_attention(queries[head], k, v, geometry, index=index, tail=True)
            recent = dense_attention(
                queries[head], keys[head, 2000:3000], values[head, 2000:3000], geometry
            )
            expected = merge_attention(indexed, recent)
            torch.testing.assert_close(out[head], expected[0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(lse[head], expected[1], rtol=1e-5, atol=1e-5)
        # An attend of more query-key pairs than exact_while_building waits instead.
        memory.exact_while_building = queries.shape[0] * queries.shape[1] * 1000 - 1
        answers = []
        waiting = threading.Thread(target=lambda: answers.append(memory.attend(queries)))
        waiting.start()
        waiting.join(timeout=0.5)
        assert waiting.is_alive()  # waits for the held build thread
    finally:
        held.set()
    blocker.result()
    waiting.join(timeout=60)
    assert not waiting.is_alive() and len(answers) == 1  # answered once the extension ended
    assert memory._extension is None and memory._indexed == 3000
    every = LocalMemory(2, 16, open_segment=0)
    every.append(keys, values)
    expected = every.attend(queries)
    torch.testing.assert_close(answers[0], expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(memory.attend(queries), expected, rtol=1e-5, atol=1e-5)


def test_a_failed_extension_is_reported_and_started_again(monkeypatch):
    keys, values, queries = _sequence(n=3000)
    memory = LocalMemory(2, 16, open_segment=1000, exact_while_building=0)
    memory.append(keys[:, :2000], values[:, :2000])
    memory.attend(queries)

    def fails(*args):
        raise RuntimeError("no memory left for the extension")

    monkeypatch.setattr(index_memory, "_extended", fails)
    memory.append(keys[:, 2000:], values[:, 2000:])
    with pytest.raises(RuntimeError, match="no memory left"):
        memory.attend(queries)
    assert memory._indexed == 2000 and memory._extension is None
    monkeypatch.undo()
    out, lse = memory.attend(queries)  # started again, and waited for
    assert memory._indexed == 3000
    every = LocalMemory(2, 16, open_segment=0)
    every.append(keys, values)
    torch.testing.assert_close((out, lse), every.attend(queries), rtol=1e-5, atol=1e-5)


def test_a_remote_memory_waits_for_the_services_index(server):
    """`wait_for_index` returns once the service has built the mode's index of the latest
    version (the commit's build runs in the background): the index state then has it built,
    nothing building, every sealed token indexed."""
    keys, values, _ = _sequence(heads=4, n=60000)
    with Client(server.url) as client:
        memory = RemoteMemory.create(client, 4, 16, mode="tail")
        try:
            memory.wait_for_index()  # empty: nothing to wait for
            memory.append(keys, values)
            memory.wait_for_index()
            state = client.index_state(memory.context_id)
            assert "tail" in state["built"] and not state["building"]
            assert state["sealed_tokens"] == sealed_keys(60000)
        finally:
            memory.close()
        exact = RemoteMemory.create(client, 4, 16, mode="exact")
        exact.append(keys[:, :100], values[:, :100])
        exact.wait_for_index()  # no index in exact mode: returns at once
        exact.close()


def test_a_cache_waits_for_the_index_of_every_layer(models, tokens):
    """`RewaCache.wait_for_index` waits for each layer's memory: with the build thread held
    busy the prompt leaves an extension queued in every layer, and the wait returns once each
    has ended, every sealed token indexed."""
    held = threading.Event()
    blocker = index_memory._builder().submit(held.wait)
    release = threading.Timer(0.5, held.set)
    try:
        with RewaCache(models[1].config, local_memories(mode="tail", open_segment=512)) as cache:
            _logits_with(models[1], tokens, cache)
            memories = [layer.memory for layer in cache.memory_layers]
            assert all(memory._extension is not None for memory in memories)
            release.start()
            cache.wait_for_index()
            for memory in memories:
                assert memory._extension is None
                assert memory._indexed == sealed_keys(memory.n_tokens, 512)
    finally:
        held.set()
        release.cancel()
    blocker.result()


def test_local_and_remote_memories_compute_the_same_attention(server):
    keys, values, queries = _sequence()
    with Client(server.url) as client:
        for mode in ("exact", "tail", "topk"):
            local = LocalMemory(2, 16, mode=mode, scale=0.3)
            remote = RemoteMemory.create(
                client, 2, 16, geometry={"name": "dot", "scale": 0.3}, mode=mode
            )
            for memory in (local, remote):
                memory.append(keys[:, :1000], values[:, :1000])
                memory.append(keys[:, 1000:], values[:, 1000:])
            assert remote.n_tokens == local.n_tokens == 3000
            (out_l, lse_l), (out_r, lse_r) = local.attend(queries), remote.attend(queries)
            torch.testing.assert_close(out_r, out_l, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(lse_r, lse_l, rtol=1e-5, atol=1e-5)
            context_id = remote.context_id
            remote.close()
            assert context_id not in {c["id"] for c in client.list_contexts()}


def test_a_local_memory_names_what_is_wrong_with_its_input():
    memory = LocalMemory(2, 16, value_dim=8)
    with pytest.raises(ValueError, match="empty memory"):
        memory.attend(torch.randn(2, 1, 16))
    with pytest.raises(ValueError, match="expected keys"):
        memory.append(torch.randn(3, 4, 16), torch.randn(3, 4, 8))
    with pytest.raises(ValueError, match="expected values"):
        memory.append(torch.randn(2, 4, 16), torch.randn(2, 4, 16))
    with pytest.raises(ValueError, match="finite"):
        memory.append(torch.full((2, 4, 16), float("nan")), torch.randn(2, 4, 8))
    memory.append(torch.randn(2, 4, 16), torch.randn(2, 4, 8))
    with pytest.raises(ValueError, match="expected queries"):
        memory.attend(torch.randn(2, 1, 15))
    with pytest.raises(ValueError, match="mode"):
        LocalMemory(2, 16, mode="dense")
    with pytest.raises(ValueError, match="budget"):
        LocalMemory(2, 16, budget=0)
    # Tail mode over a geometry without an exact lift: refused at once, not at the first
    # attend after a segment is clustered.
    with pytest.raises(ValueError, match="no exact lift"):
        LocalMemory(2, 16, geometry="cone", mode="tail")
    LocalMemory(2, 16, geometry="cone", mode="topk").close()
    assert memory.n_tokens == 4


# -- the transformers integration -------------------------------------------------------------


@pytest.mark.parametrize("where", ["local", "http"])
def test_an_exact_memory_gives_the_logits_and_the_greedy_tokens_of_full_attention(
    where, models, tokens, full_logits, server
):
    reference, model = models
    client = Client(server.url) if where == "http" else None
    memories = (
        local_memories(mode="exact") if client is None else remote_memories(client, mode="exact")
    )
    with RewaCache(model.config, memories) as cache:
        logits = _logits_with(model, tokens, cache)
        # The local part stays bounded however long the prompt: sinks + window + 2 spills.
        assert all(layer.keys.shape[2] <= 4 + 512 + 2 * 256 for layer in cache.memory_layers)
    torch.testing.assert_close(logits, full_logits, rtol=0, atol=1e-4)

    prompt = tokens[:, :1500]
    with torch.no_grad():
        expected = reference.generate(prompt, max_new_tokens=32, do_sample=False)
        with RewaCache(model.config, memories) as cache:
            generated = model.generate(
                prompt, max_new_tokens=32, do_sample=False, past_key_values=cache
            )
            assert cache.get_seq_length() == 1500 + 31
            assert all(layer.n_spilled > 0 for layer in cache.memory_layers)
    assert torch.equal(generated, expected)
    if client is not None:
        assert client.list_contexts() == []  # closing the cache deleted every layer's context
        client.close()


@pytest.mark.parametrize("where", ["local", "http"])
def test_a_tail_memory_at_two_percent_keeps_the_argmax_of_full_attention(
    where, models, tokens, full_logits, server
):
    model = models[1]
    client = Client(server.url) if where == "http" else None
    memories = (
        # Every spill indexed: the test is of tail, not of exact reads (over HTTP the open
        # segment, up to 2047 of the memory's 3500 keys, is read exactly).
        local_memories(mode="tail", budget=0.02, open_segment=0)
        if client is None
        else remote_memories(client, mode="tail", budget=0.02)
    )
    with RewaCache(model.config, memories) as cache:
        logits = _logits_with(model, tokens, cache)
    assert _argmax_agreement(logits, full_logits) >= 0.99
    if client is not None:
        client.close()


def test_local_memories_audit_the_model_queries_without_changing_the_answers(models, tokens):
    """`local_memories(audit_every=...)`: every layer's memory audits the queries the model asks
    (a kv head's grouped queries), and with a target no head misses it answers as without."""
    model = models[1]
    # exact_while_building=0: answers that never depend on when an extension ended
    options = {"mode": "tail", "budget": 0.02, "open_segment": 0, "exact_while_building": 0}
    with RewaCache(model.config, local_memories(**options)) as cache:
        plain = _logits_with(model, tokens, cache)
    audited = local_memories(**options, audit_every=8, audit_target=10.0)
    with RewaCache(model.config, audited) as cache:
        logits = _logits_with(model, tokens, cache)
        reports = [layer.memory.audit_report() for layer in cache.memory_layers]
    torch.testing.assert_close(logits, plain, rtol=0, atol=0)
    assert len(reports) == model.config.num_hidden_layers
    for report in reports:
        assert len(report) == model.config.num_key_value_heads
        for head in report:
            assert head["audited"] > 0 and head["max_keys"] > 0
            assert 0 < head["err_median"] <= head["err_p99"] < 1


@pytest.mark.parametrize("where", ["local", "http"])
def test_a_left_padded_batch_is_each_sequence_attended_alone(where, models, tokens, server):
    """A memory per sequence, holding its tokens without the padding: every sequence's logits
    are those of full attention over it alone, and so are its greedy tokens."""
    reference, model = models
    sequences = [tokens[:, :1500], tokens[:, 1500:2600], tokens[:, 2600:3300]]
    ids, mask = left_padded(sequences)
    client = Client(server.url) if where == "http" else None
    memories = (
        local_memories(mode="exact") if client is None else remote_memories(client, mode="exact")
    )
    with torch.no_grad():
        alone = [reference(sequence).logits[0] for sequence in sequences]
        spilled_alone = []
        for sequence in sequences:
            with RewaCache(model.config, local_memories(mode="exact")) as cache:
                model(sequence, past_key_values=cache)
                spilled_alone.append([layer.n_spilled for layer in cache.memory_layers])
        with RewaCache(model.config, memories) as cache:
            logits = model(ids, attention_mask=mask, past_key_values=cache).logits
            # layer by layer, sequence by sequence: each spilled what it spills alone
            spilled = [layer.n_spilled for layer in cache.memory_layers]
            assert spilled == [spilled_alone[row][layer] for layer in (0, 1) for row in (0, 1, 2)]
            assert min(spilled[:2]) > 0
            if client is not None:
                # a context per layer and sequence that spilled
                assert len(client.list_contexts()) == sum(count > 0 for count in spilled)
    for row, sequence in enumerate(sequences):
        torch.testing.assert_close(
            logits[row, -sequence.shape[-1] :], alone[row], rtol=0, atol=1e-4
        )
    if client is not None:
        assert client.list_contexts() == []
        client.close()
        return
    cache = RewaCache(model.config, memories)
    assert_generates_each_alone(reference, model, cache, sequences, ids, mask, 12)


class _MeetingMemory(RemoteMemory):
    """A remote memory whose decode-step attends (a query per query head) wait until as many
    memories as `meeting` counts are in one at the same time."""

    meeting: threading.Barrier | None = None

    def attend(self, queries):
        if self.meeting is not None and queries.shape[1] <= 2:  # 4 query heads on 2 kv heads
            self.meeting.wait(timeout=20)
        return super().attend(queries)


def test_a_batch_asks_its_sequences_remote_memories_at_once(models, tokens, server):
    """In a decode step, every sequence's remote memory is asked before any answer is awaited:
    their requests are in flight together (one after another, the first would wait for the
    others in vain), and the tokens are each sequence's own."""
    reference, model = models
    sequences = [tokens[:, :400], tokens[:, 400:700], tokens[:, 700:900]]
    ids, mask = left_padded(sequences)
    client = Client(server.url)

    def meeting_memories(layer, heads, head_dim, value_dim, scale):
        geometry = {"name": "dot", "scale": scale}
        return _MeetingMemory.create(
            client, heads, head_dim, value_dim=value_dim, geometry=geometry, mode="exact"
        )

    cache = RewaCache(model.config, meeting_memories, window=64, spill=32)
    _MeetingMemory.meeting = threading.Barrier(len(sequences))
    try:
        assert_generates_each_alone(reference, model, cache, sequences, ids, mask, 4)
    finally:
        _MeetingMemory.meeting = None
    assert client.list_contexts() == []
    client.close()


def test_a_prefill_chunk_of_nothing_but_padding(models, tokens):
    """A batch padded beyond its longest sequence, prefilled in chunks: the first chunk holds
    no token of any sequence, and every sequence still gets its greedy tokens alone."""
    reference, model = models
    sequences = [tokens[:, :600], tokens[:, 600:950]]
    ids, mask = left_padded(sequences, length=1024)
    cache = RewaCache(model.config, local_memories(mode="exact"), window=64, spill=32)
    assert_generates_each_alone(
        reference, model, cache, sequences, ids, mask, 8, prefill_chunk_size=256
    )


def test_sampled_sequences_of_one_prompt_have_a_memory_each(models, tokens):
    """`num_return_sequences` makes a batch of the prompt before the first forward pass."""
    reference, model = models
    prompt = tokens[:, :1200]
    options = {"do_sample": True, "num_return_sequences": 3, "max_new_tokens": 8}
    with torch.no_grad():
        torch.manual_seed(5)
        expected = reference.generate(prompt, **options)
        with RewaCache(model.config, local_memories(mode="exact")) as cache:
            torch.manual_seed(5)
            generated = model.generate(prompt, past_key_values=cache, **options)
            assert len(cache.memory_layers) == 2 * 3
    assert torch.equal(generated, expected)


def test_layers_outside_the_chosen_subset_keep_every_token(models, tokens, full_logits):
    model = models[1]
    with RewaCache(model.config, local_memories(mode="exact"), layers=[1]) as cache:
        logits = _logits_with(model, tokens, cache)
        assert [layer.layer_idx for layer in cache.memory_layers] == [1]
        assert cache.layers[0].keys.shape[2] == TOKENS
    torch.testing.assert_close(logits, full_logits, rtol=0, atol=1e-4)


def test_without_a_rewa_cache_the_rewa_attention_is_full_causal_attention(
    models, tokens, full_logits
):
    with torch.no_grad():
        logits = models[1](tokens[:, :600], use_cache=False).logits
    torch.testing.assert_close(logits, full_logits[:, :600], rtol=0, atol=1e-4)


def test_the_integration_refuses_what_it_cannot_compute(models, tokens):
    model = models[1]
    memories = local_memories(mode="exact")
    with torch.no_grad():
        with pytest.raises(ValueError, match="beam search"):  # a memory per beam
            model.generate(
                tokens[:, :8],
                num_beams=2,
                max_new_tokens=2,
                past_key_values=RewaCache(model.config, memories),
            )
        cache = RewaCache(model.config, memories)
        model(tokens[:, :8].repeat(2, 1), past_key_values=cache)
        with pytest.raises(ValueError, match="batch of 3"):  # the cache holds 2 sequences
            model(tokens[:, 8:9].repeat(3, 1), past_key_values=cache)
        with pytest.raises(ValueError, match="4D"):
            model(tokens[:, :8], attention_mask=torch.ones(1, 1, 8, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match="layers"):
        RewaCache(model.config, memories, layers=[2])
    with pytest.raises(ValueError, match="spill"):
        RewaCache(model.config, memories, spill=0)


# -- an encoder: MiniLM reading a document window by window -----------------------------------


def test_minilm_with_an_exact_memory_at_every_layer_is_block_causal_full_attention():
    """MiniLM (real weights, offline) reads 8 windows of the standard library's sources with an
    `EncoderMemory` at each of its 6 layers. With exact memories every window's final hidden
    states equal one forward over the whole document whose mask lets each window see itself
    and every earlier window (positions restarting per window, as the windows were read). The
    sparse modes run the same way (their errors: benchmarks/minilm_layers.py)."""
    from benchmarks.text_data import load_model, source_tokens

    sentence_model = load_model()
    bert, tokenizer = sentence_model[0].auto_model, sentence_model.tokenizer
    content, n_windows = 126, 8
    ids, _ = source_tokens(tokenizer, content * n_windows)
    cls, sep = torch.tensor([tokenizer.cls_token_id]), torch.tensor([tokenizer.sep_token_id])
    windows = [torch.cat([cls, part, sep]) for part in ids.split(content)]
    length = content + 2
    window_of = torch.arange(n_windows).repeat_interleave(length)
    block_causal = window_of.unsqueeze(1) >= window_of.unsqueeze(0)
    bert.set_attn_implementation("sdpa")
    with torch.no_grad():
        reference = bert(
            input_ids=torch.cat(windows).unsqueeze(0),
            position_ids=torch.arange(length).repeat(n_windows).unsqueeze(0),
            attention_mask=block_causal.view(1, 1, *block_causal.shape),
        ).last_hidden_state[0]
    enable(bert)
    results = {}
    for mode in ("exact", "tail", "topk"):
        with EncoderMemory(local_memories(mode=mode)) as memory, memory.reading():
            with torch.no_grad():
                states = [bert(input_ids=w.unsqueeze(0)).last_hidden_state[0] for w in windows]
            assert sorted(memory.memories) == list(range(6))
            assert all(m.n_tokens == length * n_windows for m in memory.memories.values())
        results[mode] = torch.cat(states)
    torch.testing.assert_close(results["exact"], reference, rtol=0, atol=1e-4)
    for mode in ("tail", "topk"):  # the first window has no memory: exact in every mode
        torch.testing.assert_close(results[mode][:length], reference[:length], rtol=0, atol=1e-4)
        assert torch.isfinite(results[mode]).all()
    bert.set_attn_implementation("sdpa")


def test_a_document_refuses_what_it_could_not_commit(models, tokens, server):
    model = models[1]
    with Client(server.url) as client:
        document = RemoteDocument(client, range(2), mode="exact")
        cache = RewaCache(model.config, document.memory, window=64, spill=32)
        with torch.no_grad(), cache, pytest.raises(ValueError, match="one sequence"):
            model(tokens[:, :200].repeat(2, 1), past_key_values=cache)
        assert client.list_contexts() == []  # closing the cache deleted the document
        # A document layer the cache never spills would hold back every commit.
        with pytest.raises(ValueError, match="document holds layers"):
            RewaCache(model.config, RemoteDocument(client, [0, 1]).memory, layers=[1])


@pytest.mark.parametrize("mode", ["exact", "tail"])
def test_every_layer_in_one_multi_layer_document(mode, models, tokens, full_logits, server):
    """`RemoteDocument`: one context holds every layer's memory, one commit per spill for all
    layers (each layer reads its staged tokens exactly until the last layer has spilled them)."""
    reference, model = models
    with Client(server.url) as client:
        document = RemoteDocument(client, range(2), mode=mode)
        with RewaCache(model.config, document.memory) as cache:
            logits = _logits_with(model, tokens, cache)
            (context,) = client.list_contexts()
            assert (context["layers"], context["n_tokens"]) == (2, cache.memory_layers[0].n_spilled)
            assert all(not blocks for blocks in document.staged.values())
        assert client.list_contexts() == []
        if mode == "exact":
            torch.testing.assert_close(logits, full_logits, rtol=0, atol=1e-4)
            prompt = tokens[:, :1500]
            with torch.no_grad():
                expected = reference.generate(prompt, max_new_tokens=32, do_sample=False)
                with RewaCache(
                    model.config, RemoteDocument(client, [0, 1], mode=mode).memory
                ) as cache:
                    generated = model.generate(
                        prompt, max_new_tokens=32, do_sample=False, past_key_values=cache
                    )
            assert torch.equal(generated, expected)
        else:
            assert _argmax_agreement(logits, full_logits) >= 0.99
        with pytest.raises(ValueError, match="distinct"):
            RemoteDocument(client, [0, 0])
