"""Support for the transformers integration's tests: batches of sequences padded on the left,
as `generate` makes them, and the check that such a batch generates each sequence's tokens."""

from __future__ import annotations

import torch


def left_padded(sequences: list[torch.Tensor], length: int | None = None, pad: int = 0):
    """`(batch, length)` token ids (default length: the longest sequence's) with each sequence
    `(1, n)` at the right of its row, and the attention mask, 1 at the tokens."""
    length = max(sequence.shape[-1] for sequence in sequences) if length is None else length
    ids = torch.full((len(sequences), length), pad)
    mask = torch.zeros(len(sequences), length, dtype=torch.long)
    for row, sequence in enumerate(sequences):
        ids[row, length - sequence.shape[-1] :] = sequence[0]
        mask[row, length - sequence.shape[-1] :] = 1
    return ids, mask


def assert_generates_each_alone(
    reference, model, cache, sequences, ids, mask, new_tokens, **options
):
    """Greedy generation of the padded batch `ids`, `mask` with `model` and `cache` gives every
    sequence the `new_tokens` tokens `reference` generates for it alone."""
    with torch.no_grad():
        expected = [
            reference.generate(sequence, max_new_tokens=new_tokens, do_sample=False)[0]
            for sequence in sequences
        ]
        with cache:
            generated = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
                past_key_values=cache,
                **options,
            )
    for row, alone in enumerate(expected):
        assert torch.equal(generated[row, -new_tokens:], alone[-new_tokens:])
