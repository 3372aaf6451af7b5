"""The transformers integration on architectures other than Llama (docs/llm.md, "Models"):
sliding-window layers (Mistral, Gemma 3, gpt-oss) and learned attention sinks (gpt-oss)
against the same model with transformers' eager attention, and what is refused (logit
soft-capping, models outside transformers' attention interface, a cache the model's attention
never reads, layer kinds a cache cannot hold). Tiny models built from configs, no weights
downloaded."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from transformers.masking_utils import create_sliding_window_causal_mask

from rewa.llm import EncoderMemory, RewaCache, enable, local_memories
from tests.llm_support import left_padded

TOKENS = 1200
WINDOW = 100  # the models' sliding window, far shorter than the prompt
COMMON = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "initializer_range": 0.05,
}
MODELS = {
    # every layer a sliding window
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": WINDOW}),
    # a sliding layer, then a full one (the memory's)
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {
            "head_dim": 16,
            "sliding_window": WINDOW,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),
    # sliding and full layers, and a learned sink logit per head in both
    "gpt-oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        {
            "head_dim": 16,
            "sliding_window": WINDOW,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
        },
    ),
}


def _pair(name: str, **changes):
    """The model with transformers' eager attention (the reference) and the same weights with
    rewa attention, each with its own config."""
    config_class, model_class, extra = MODELS[name]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**{**COMMON, **extra, **changes})
    reference = getattr(transformers, model_class)(config).eval()
    reference.set_attn_implementation("eager")
    model = getattr(transformers, model_class)(copy.deepcopy(config)).eval()
    model.load_state_dict(reference.state_dict())
    return reference, enable(model)


@pytest.fixture(scope="module")
def tokens():
    # no token 0 or 1: they are some of these configs' padding ids, which generate() masks
    return torch.randint(2, 256, (1, TOKENS), generator=torch.Generator().manual_seed(3))


def _cache(model, **options):
    return RewaCache(model.config, local_memories(**options), window=64, sinks=4, spill=32)


@pytest.mark.parametrize("name", list(MODELS))
def test_an_exact_memory_gives_the_logits_of_eager_attention(name, tokens):
    reference, model = _pair(name)
    with torch.no_grad():
        expected = reference(tokens).logits
        without_cache = model(tokens, use_cache=False).logits
        with _cache(model, mode="exact") as cache:
            logits = model(tokens, past_key_values=cache, use_cache=True).logits
            windows = [getattr(layer, "sliding_window", None) for layer in cache.layers]
            # A sliding layer keeps only its window; a full one spills into its memory.
            for layer, window in zip(cache.layers, windows, strict=True):
                if window is not None:
                    assert layer.keys.shape[-2] == WINDOW - 1
            assert [layer.layer_idx for layer in cache.memory_layers] == [
                i for i, window in enumerate(windows) if window is None
            ]
            assert all(layer.n_spilled > TOKENS // 2 for layer in cache.memory_layers)
    torch.testing.assert_close(without_cache, expected, rtol=0, atol=1e-4)
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-4)


@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_generation_equals_eager_attention(name, tokens):
    reference, model = _pair(name)
    prompt = tokens[:, :400]
    mask = torch.ones_like(prompt)
    with torch.no_grad():
        expected = reference.generate(
            prompt, attention_mask=mask, max_new_tokens=16, do_sample=False
        )
        with _cache(model, mode="exact") as cache:
            generated = model.generate(
                prompt,
                attention_mask=mask,
                max_new_tokens=16,
                do_sample=False,
                past_key_values=cache,
            )
    assert torch.equal(generated, expected)


@pytest.mark.parametrize("name", ["gemma3", "gpt-oss"])
def test_a_left_padded_batch_is_each_sequence_attended_alone(name, tokens):
    """Sliding windows and sinks over a left-padded batch: each sequence's logits are those of
    eager attention over it alone (a window counts the padding's positions, as transformers'
    mask does, and the padding precedes every token, so a query sees the same tokens)."""
    reference, model = _pair(name)
    sequences = [tokens[:, :900], tokens[:, 900:1200]]
    ids, mask = left_padded(sequences)
    with torch.no_grad():
        with _cache(model, mode="exact") as cache:
            logits = model(ids, attention_mask=mask, past_key_values=cache, use_cache=True).logits
            assert len(cache.memory_layers) == 2  # one full-attention layer, two sequences
        without_cache = model(ids, attention_mask=mask, use_cache=False).logits
        for row, sequence in enumerate(sequences):
            expected = reference(sequence).logits[0]
            n = sequence.shape[-1]
            torch.testing.assert_close(logits[row, -n:], expected, rtol=0, atol=1e-4)
            torch.testing.assert_close(without_cache[row, -n:], expected, rtol=0, atol=1e-4)


def test_a_tail_memory_under_sinks_keeps_the_argmax_of_eager_attention(tokens):
    reference, model = _pair("gpt-oss")
    with torch.no_grad():
        expected = reference(tokens).logits
        with _cache(model, mode="tail", budget=0.05, open_segment=0) as cache:
            logits = model(tokens, past_key_values=cache, use_cache=True).logits
            assert cache.memory_layers[0].memory.n_tokens > TOKENS // 2
    agreement = (logits.argmax(-1) == expected.argmax(-1)).float().mean().item()
    assert agreement >= 0.99


def test_an_encoder_without_layer_indexes_has_a_memory_per_layer(tokens):
    """DistilBERT's attention modules carry no `layer_idx`: `EncoderMemory` tells its layers
    apart by the order they attend, so each has its own memory, and the first window (no
    memory yet) is the model's own answer."""
    config = transformers.DistilBertConfig(
        vocab_size=256, dim=64, n_layers=2, n_heads=4, hidden_dim=128
    )
    torch.manual_seed(0)
    reference = transformers.DistilBertModel(config).eval()
    model = transformers.DistilBertModel(copy.deepcopy(config)).eval()
    model.load_state_dict(reference.state_dict())
    enable(model)
    windows = tokens[:, :160].split(40, dim=1)
    with torch.no_grad():
        expected = reference(input_ids=windows[0]).last_hidden_state
        with EncoderMemory(local_memories(mode="exact")) as memory, memory.reading():
            states = [model(input_ids=window).last_hidden_state for window in windows]
            assert {layer: m.n_tokens for layer, m in memory.memories.items()} == {0: 160, 1: 160}
    torch.testing.assert_close(states[0], expected, rtol=0, atol=1e-5)


def test_what_the_integration_cannot_compute_is_refused(tokens):
    torch.manual_seed(0)
    gemma2 = transformers.Gemma2Config(**COMMON, head_dim=16, sliding_window=WINDOW)
    with pytest.raises(ValueError, match="soft-capping"), torch.no_grad():
        enable(transformers.Gemma2ForCausalLM(gemma2).eval())(tokens[:, :8])

    falcon = transformers.FalconConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4
    )
    with pytest.raises(ValueError, match="AttentionInterface"):
        enable(transformers.FalconForCausalLM(falcon).eval())

    # A cache the model's own attention never reads would leave its spilled tokens out.
    llama = transformers.LlamaConfig(**COMMON)
    plain = transformers.LlamaForCausalLM(llama).eval()
    cache = _cache(plain, mode="exact")
    with torch.no_grad(), cache, pytest.raises(ValueError, match="enable"):
        plain(tokens[:, :8], past_key_values=cache)
    # Another cache is not held to what this one's model left undone.
    with torch.no_grad(), RewaCache(llama, local_memories(mode="exact")) as cache:
        enable(copy.deepcopy(plain))(tokens[:, :8], past_key_values=cache)

    # DeepSeek's multi-head latent attention caches compressed latents, not keys and values.
    deepseek = transformers.DeepseekV3Config(
        **{**COMMON, "num_key_value_heads": 4},
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=12,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_group=1,
        topk_group=1,
    )
    latent = enable(transformers.DeepseekV3ForCausalLM(deepseek).eval())
    cache = _cache(latent, mode="exact")
    with torch.no_grad(), cache, pytest.raises(ValueError, match="something else"):
        latent(tokens[:, :200], past_key_values=cache)

    chunked = transformers.Llama4TextConfig(**COMMON, attention_chunk_size=64)
    chunked.layer_types = ["chunked_attention", "full_attention"]
    with pytest.raises(ValueError, match="chunked_attention"):
        RewaCache(chunked, local_memories(mode="exact"))

    # Packed sequences (positions restarting within one row): transformers' packed mask.
    _, mistral = _pair("mistral")
    positions = torch.cat([torch.arange(200), torch.arange(200)]).unsqueeze(0)
    with torch.no_grad(), pytest.raises(ValueError, match="packed"):
        mistral(tokens[:, :400], position_ids=positions, use_cache=False)
    # A window whose tokens 10-19 also see each other (an image's tokens in Gemma 3's mask).
    embeddings = torch.zeros(1, 50, COMMON["hidden_size"])
    create_sliding_window_causal_mask(mistral.config, embeddings, None, None)  # a plain window

    def image(batch, head, query, key):
        return (query >= 10) & (query < 20) & (key >= 10) & (key < 20)

    with pytest.raises(ValueError, match="sliding window"):
        create_sliding_window_causal_mask(
            mistral.config, embeddings, None, None, or_mask_function=image
        )

    _, model = _pair("gemma3")
    with pytest.raises(ValueError, match="sliding window"):
        RewaCache(model.config, local_memories(mode="exact"), layers=[0, 1])
    # A cache made from another config than the model's: its layer 0 keeps every token.
    other = copy.deepcopy(model.config)
    other.layer_types = ["full_attention", "full_attention"]
    cache = RewaCache(other, local_memories(mode="exact"))
    with torch.no_grad(), cache, pytest.raises(ValueError, match="window of 100"):
        model(tokens[:, :8], past_key_values=cache)
