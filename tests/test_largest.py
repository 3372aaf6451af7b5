"""Each row's k largest entries by the compiled loop (`rewa.index.largest`): `topk`'s answer,
ties in ascending column order, over tables spread across threads."""

import numpy as np
import pytest
import torch

from rewa.index import largest


def stable_descending(table: torch.Tensor, k: int) -> torch.Tensor:
    """The columns of each row's k largest entries, ties in ascending column order."""
    return torch.from_numpy(np.argsort(-table.numpy(), axis=1, kind="stable")[:, :k].copy())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("rows", "columns", "k"), [(3000, 512, 16), (5, 130, 16), (77, 64, 8)])
def test_the_largest_entries_are_topks_largest_first(dtype, rows, columns, k):
    generator = torch.Generator().manual_seed(rows)
    table = torch.randn(rows, columns, generator=generator, dtype=dtype)
    assert largest.applies(k, columns, dtype)
    values, found = largest.row_largest(table, k)
    expected = table.topk(k)
    assert found.dtype == torch.long and values.dtype == dtype
    assert torch.equal(values, expected.values)
    assert torch.equal(found, stable_descending(table, k))


def test_ties_go_to_the_lower_column_first():
    # Entries rounded to a few values: most of a row's top entries are tied.
    generator = torch.Generator().manual_seed(1)
    table = (torch.randn(2500, 256, generator=generator) * 2).round()
    values, found = largest.row_largest(table, 16)
    assert torch.equal(found, stable_descending(table, 16))
    assert (values[:, :-1] >= values[:, 1:]).all()
    constant = torch.zeros(3, 200)
    assert torch.equal(largest.row_largest(constant, 10)[1], torch.arange(10).expand(3, -1))


def test_entries_of_minus_infinity_come_after_every_number():
    generator = torch.Generator().manual_seed(2)
    table = torch.randn(40, 256, generator=generator)
    table[3, :250] = -torch.inf  # six numbers, then ten of the masked entries
    table[7] = -torch.inf
    values, found = largest.row_largest(table, 16)
    assert torch.equal(values, table.topk(16).values)
    assert torch.equal(found, stable_descending(table, 16))
    assert found[3, :6].tolist() == (250 + table[3, 250:].argsort(descending=True)).tolist()
    assert found[7].tolist() == list(range(16))


def test_a_row_with_nan_is_ranked_as_topk_ranks_it():
    generator = torch.Generator().manual_seed(3)
    table = torch.randn(50, 256, generator=generator)
    table[5, 7] = torch.nan
    values, found = largest.row_largest(table, 16)
    expected = table.topk(16)
    assert found[5, 0] == 7 and torch.equal(found, expected.indices)
    torch.testing.assert_close(values, expected.values, equal_nan=True)


def test_which_tables_the_loop_takes():
    assert largest.applies(16, 128, torch.float32)
    assert largest.applies(largest.MAX_K, largest.MAX_K * largest.MIN_GROUP, torch.float64)
    assert not largest.applies(16, 127, torch.float32)  # fewer than MIN_GROUP per group
    assert not largest.applies(largest.MAX_K + 1, 4096, torch.float32)
    assert not largest.applies(0, 128, torch.float32)
    assert not largest.applies(4, 128, torch.bfloat16)
