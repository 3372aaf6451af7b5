"""The audit of a memory's answers (index/audit.py, `LocalMemory(audit_every=...)`): one query
row in `audit_every`, counted over the memory's life, is also answered exactly; the errors are
kept per head, and a tail head whose 99th percentile over a full window passes the target, or
surely will once the window is full, gets pieces of half the size. The heads here: keys around
centres, `scale` times as long; at 8192 keys a scale of 1.2 gives a sharp head whose tail
answers miss the default target (p99 0.15) and a scale of 0.3 a diffuse one far within it."""

import threading
from dataclasses import fields

import pytest
import torch

from rewa.attention import dense_attention, make_geometry
from rewa.index import KeyClusters, LocalMemory
from rewa.index import memory as index_memory
from rewa.index.audit import AUDIT_TARGET, AUDIT_WINDOW, AUDITS_WAITING, Audit, certain_misses
from rewa.index.clusters import MIN_CLUSTER_KEYS
from rewa.index.measures import output_error

D, N = 16, 8192


def _head(n: int, scale: float, seed: int):
    generator = torch.Generator().manual_seed(seed)
    centres = torch.randn(max(1, n // 512), D, generator=generator)
    labels = torch.randint(len(centres), (n,), generator=generator)
    k = (centres[labels] + torch.randn(n, D, generator=generator)) * scale
    return k, k @ torch.randn(D, D, generator=generator)


def _sharp_and_diffuse(n: int = N):
    """Keys and values `(2, n, D)`: head 0 sharp, head 1 diffuse."""
    (k0, v0), (k1, v1) = _head(n, 1.2, seed=0), _head(n, 0.3, seed=1)
    return torch.stack([k0, k1]), torch.stack([v0, v1])


def _queries(keys: torch.Tensor, m: int, seed: int = 5) -> torch.Tensor:
    """`m` queries per head near that head's keys."""
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randint(keys.shape[1], (keys.shape[0], m), generator=generator)
    near = torch.gather(keys, 1, rows[..., None].expand(-1, -1, D))
    return near + 0.1 * torch.randn(near.shape, generator=generator)


def _memory(keys, values, **options) -> LocalMemory:
    options = {"open_segment": 0, "probed_pieces": False, "exact_while_building": 0} | options
    memory = LocalMemory(keys.shape[0], D, **options)
    memory.append(keys, values)
    return memory


def _assert_same(mine: KeyClusters, theirs: KeyClusters) -> None:
    for field in fields(KeyClusters):
        if field.name != "geometry":
            a, b = getattr(mine, field.name), getattr(theirs, field.name)
            assert a.shape == b.shape and torch.equal(a, b), field.name


def test_the_audited_rows_are_counted_over_the_memory_life():
    audit = Audit(heads=1, every=4)
    assert audit.rows(7).tolist() == [0, 4]
    assert audit.rows(1).tolist() == []  # row 7
    assert audit.rows(10).tolist() == [0, 4, 8]  # rows 8, 12, 16
    assert audit.rows(3).tolist() == [2]  # row 20 of 18-20
    one_by_one = Audit(heads=1, every=64)
    assert [one_by_one.rows(1).tolist() for _ in range(130)] == (
        [[0]] + [[]] * 63 + [[0]] + [[]] * 63 + [[0], []]
    )


def test_the_report_holds_the_errors_of_the_audited_answers():
    keys, values = _sharp_and_diffuse()
    memory = _memory(keys, values, audit_every=4, audit_window=1000)
    queries = _queries(keys, 30)
    outs = [memory.attend(queries[:, rows])[0] for rows in (slice(0, 7), slice(7, 8), slice(8, 30))]
    out = torch.cat(outs, dim=1)
    audited = torch.arange(0, 30, 4)
    exact, _ = dense_attention(queries[:, audited], keys, values, make_geometry("dot", D))
    errors = output_error(out[:, audited], exact).double()
    report = memory.audit_report()
    # The memory computes the exact answers in calls of other rows, on its audit thread
    # (float32 sums in another order): the errors agree to about 1e-7.
    for head in range(2):
        assert report[head]["audited"] == len(audited)
        assert report[head]["err_median"] == pytest.approx(
            errors[head].quantile(0.5).item(), abs=1e-6
        )
        assert report[head]["err_p99"] == pytest.approx(
            errors[head].quantile(0.99).item(), abs=1e-6
        )
        assert report[head]["max_keys"] == int(memory._indexes[head].max_keys)
    # The sharp head's answers are the worse ones, and each is a real error.
    assert report[0]["err_p99"] > report[1]["err_p99"] > 0


def test_a_head_whose_audit_misses_gets_pieces_of_half_the_size():
    keys, values = _sharp_and_diffuse()
    g = make_geometry("dot", D)
    memory = _memory(keys, values, audit_every=2, audit_window=128)
    queries = _queries(keys, 256)
    memory.attend(queries)  # a full window of 128 errors per head
    before = memory.audit_report()
    assert before[0]["err_p99"] > AUDIT_TARGET >= before[1]["err_p99"]
    default = int(KeyClusters.build(keys[0], values[0], g, probed_pieces=False).max_keys)
    memory.wait_for_index()  # the sharp head's pieces cut again, on the build thread
    report = memory.audit_report()
    assert [row["max_keys"] for row in report] == [default // 2, default]
    assert [row["audited"] for row in report] == [0, 128]  # the sharp head's errors forgotten
    halved = KeyClusters.build(keys[0], values[0], g, max_cluster_keys=default // 2)
    _assert_same(memory._indexes[0], halved)
    _assert_same(memory._indexes[1], KeyClusters.build(keys[1], values[1], g, probed_pieces=False))
    memory.attend(queries)  # the same rows audited again: the halved pieces err less
    assert memory.audit_report()[0]["err_p99"] < 0.8 * before[0]["err_p99"]


def test_a_head_is_judged_once_its_window_will_surely_miss():
    # Over a full window of 512 the 99th percentile interpolates between the 506th and 507th
    # smallest errors: 7 errors above the target put it above, whatever the other 505.
    assert certain_misses(512) == 7
    audit = Audit(heads=2, every=1, window=512)
    audit.record(torch.tensor([[0.5] * 6 + [0.0] * 100, [0.0] * 106]), audit.versions())
    assert audit.missing(0.15) == []  # 6 above: a full window of them may still pass
    audit.record(torch.tensor([[0.5], [0.0]]), audit.versions())
    assert audit.missing(0.15) == [0]  # 7 above, 107 of 512 errors kept
    surely = torch.tensor([0.16] * 7 + [0.0] * 505, dtype=torch.float64)
    assert surely.quantile(0.99).item() > 0.15
    # With 6 above, a full window is judged by its 99th percentile: 0.89 of the way from the
    # 506th smallest error to the 507th.
    full = Audit(heads=2, every=1, window=512)
    full.record(torch.tensor([[0.0] * 506 + [0.16] * 6, [0.0] * 506 + [0.2] * 6]), full.versions())
    assert full.missing(0.15) == [1]  # p99 0.142 and 0.178


def test_a_head_that_surely_misses_is_cut_before_its_window_is_full():
    keys, values = _sharp_and_diffuse()
    memory = _memory(keys, values, audit_every=2, audit_target=0.1)
    queries = _queries(keys, 256)
    g = make_geometry("dot", D)
    built = [
        int(KeyClusters.build(k, v, g, probed_pieces=False).max_keys)
        for k, v in zip(keys, values, strict=True)
    ]
    out, _ = memory.attend(queries)  # 128 audited rows per head, of a window of 512
    exact, _ = dense_attention(queries[:, ::2], keys, values, g)
    above = (output_error(out[:, ::2], exact) > 0.1).sum(dim=1).tolist()
    assert above[0] >= certain_misses(AUDIT_WINDOW) > above[1] and AUDIT_WINDOW > 128
    memory.wait_for_index()
    report = memory.audit_report()
    assert [row["max_keys"] for row in report] == [built[0] // 2, built[1]]
    assert [row["audited"] for row in report] == [0, 128]  # the cut head's errors forgotten


def test_the_errors_of_answers_from_pieces_cut_since_are_not_kept():
    """A call answered by the pieces before a cut, audited after it: its errors do not enter
    the cut head's new window (7 of them above the target would cut it again at once)."""
    keys, values = _sharp_and_diffuse()
    memory = _memory(keys, values, audit_every=2, audit_target=0.1)
    queries = _queries(keys, 256)
    built = int(KeyClusters.build(keys[0], values[0], make_geometry("dot", D)).max_keys)
    cutting, auditing = threading.Event(), threading.Event()
    index_memory._builder().submit(cutting.wait)  # the cut waits
    memory.attend(queries)
    memory._take_audits(wait=True)  # the sharp head surely misses: its cut is handed over
    assert memory._extension is not None and memory._recutting == 0
    index_memory._auditor().submit(auditing.wait)  # the next audits wait
    memory.attend(queries)  # answered by the pieces before the cut, audited after it
    cutting.set()
    memory._extension.exception()  # the cut is done; the next call takes it
    memory.attend(queries)  # answered by the halved pieces
    assert int(memory._indexes[0].max_keys) == built // 2
    auditing.set()
    report = memory.audit_report()
    assert [row["audited"] for row in report] == [128, 384]  # the third call's / all three's
    memory.wait_for_index()
    assert int(memory._indexes[0].max_keys) == built // 2


def test_a_head_is_halved_again_only_where_its_halving_mended_it():
    audit = Audit(heads=3, every=1, window=512)
    misses = [0.0] * 93 + [0.3] * 7  # 7 of 100 errors above 0.15: a sure miss
    audit.record(torch.tensor([misses] * 3), audit.versions())
    assert audit.to_cut(0.15, [256, 256, 256]) == (0, 128)
    audit.clear(0)  # head 0 cut
    # Head 0 misses again, 7 of 100 above the target again (> 0.8 x 7 %): the halving did not
    # mend it. It is settled, and its pieces go back to the size they had.
    audit.record(
        torch.tensor([[0.0] * 93 + [0.28] * 7, [0.0] * 100, [0.0] * 100]), audit.versions()
    )
    assert audit.to_cut(0.15, [128, 256, 256]) == (0, 256)
    assert [row["settled"] for row in audit.report()] == [True, False, False]
    audit.clear(0)
    audit.record(torch.tensor([[5.0] * 100, [0.0] * 100, [0.0] * 100]), audit.versions())
    # A settled head is never chosen again, however far it misses: head 1 is next (7 of its
    # 300 errors above the target).
    assert audit.to_cut(0.15, [256, 256, 256]) == (1, 128)
    # A head chosen but not cut since (its cut failed) is chosen again.
    assert audit.to_cut(0.15, [256, 256, 256]) == (1, 128)
    audit.clear(1)
    # Head 1 misses again, 7 of 400 errors above the target against 7 of 300 before (a share
    # of 0.75 of it, within 0.8): halved again.
    audit.record(
        torch.tensor([[0.0] * 400, [0.0] * 393 + [0.2] * 7, [0.0] * 400]), audit.versions()
    )
    assert audit.to_cut(0.15, [256, 128, 256]) == (1, 64)
    # Pieces are never halved below the smallest size (head 2 misses too).
    assert audit.to_cut(0.15, [256, 2 * MIN_CLUSTER_KEYS - 1, 2 * MIN_CLUSTER_KEYS - 1]) is None


def test_a_head_whose_halving_does_not_mend_it_is_settled():
    """Random keys and values, the service benchmark's: the answers are averages of many
    random values, near zero, so relative errors are large however the keys are cut. The
    audit halves the head once; the halved pieces miss by as much, so its pieces go back to
    their size, and it is cut no more."""
    generator = torch.Generator().manual_seed(3)
    keys, values = torch.randn(2, 1, 32768, 64, generator=generator)
    queries = torch.randn(1, 2048, 64, generator=generator)
    memory = LocalMemory(1, 64, open_segment=0, exact_while_building=0, audit_every=2)
    memory.append(keys, values)
    memory.attend(queries[:, :1])
    built = int(memory._indexes[0].max_keys)
    for chunk in queries.split(512, dim=1):
        memory.attend(chunk)  # 256 audited rows
        memory.wait_for_index()
    report = memory.audit_report()[0]
    assert report["max_keys"] == built and report["settled"] and built // 2 >= MIN_CLUSTER_KEYS
    assert report["err_p99"] > AUDIT_TARGET  # it still misses
    _assert_same(
        memory._indexes[0],
        KeyClusters.build(
            keys[0],
            values[0],
            make_geometry("dot", 64),
            max_cluster_keys=built,
            probed_pieces=False,
        ),
    )


def test_no_head_is_cut_within_the_target_or_below_the_smallest_pieces():
    keys, values = _sharp_and_diffuse()
    queries = _queries(keys, 256)
    within = _memory(keys, values, audit_every=2, audit_window=128, audit_target=10.0)
    within.attend(queries)
    within.wait_for_index()
    built = [int(head.max_keys) for head in within._indexes]
    assert [row["max_keys"] for row in within.audit_report()] == built
    assert [row["audited"] for row in within.audit_report()] == [128, 128]
    # A target no answer meets: every error is above it, and halving leaves them all above,
    # so each head is halved once, one at a time, goes back to its pieces and is settled.
    strict = _memory(keys, values, audit_every=2, audit_window=128, audit_target=1e-12)
    for _ in range(8):
        strict.attend(queries)
        strict.wait_for_index()
    report = strict.audit_report()
    assert [row["max_keys"] for row in report] == built
    assert [row["settled"] for row in report] == [True, True]
    assert built[0] // 2 >= MIN_CLUSTER_KEYS and built[1] // 2 >= MIN_CLUSTER_KEYS


def test_appended_tokens_keep_the_size_the_audit_chose():
    keys, values = _sharp_and_diffuse(2 * N + 300)  # appends past 2 N retrain the clusters
    g = make_geometry("dot", D)
    memory = _memory(keys[:, :N], values[:, :N], audit_every=2, audit_window=128)
    memory.attend(_queries(keys[:, :N], 256))
    memory.wait_for_index()
    halved = int(memory._indexes[0].max_keys)
    for start, end in ((N, N + 500), (N + 500, 2 * N + 300)):  # an extension, a retraining
        memory.append(keys[:, start:end], values[:, start:end])
        memory.wait_for_index()
        assert int(memory._indexes[0].max_keys) == halved
    whole = KeyClusters.build(keys[0], values[0], g, max_cluster_keys=halved, probed_pieces=False)
    assert torch.equal(memory._indexes[0].order, whole.order)
    _assert_same(memory._indexes[1], KeyClusters.build(keys[1], values[1], g, probed_pieces=False))


def test_a_topk_memory_is_audited_and_never_cut():
    keys, values = _sharp_and_diffuse()
    memory = _memory(keys, values, mode="topk", audit_every=2, audit_window=128, audit_target=1e-12)
    queries = _queries(keys, 256)
    out, _ = memory.attend(queries)
    exact, _ = dense_attention(queries[:, ::2], keys, values, make_geometry("dot", D))
    report = memory.audit_report()
    assert "max_keys" not in report[0]
    for head in range(2):
        errors = output_error(out[head, ::2], exact[head]).double()
        assert report[head]["err_p99"] == pytest.approx(errors.quantile(0.99).item(), abs=1e-6)
    assert memory._extension is None


def test_a_memory_without_audit_and_bad_audit_options_are_refused():
    with pytest.raises(ValueError, match="no audit"):
        LocalMemory(1, D).audit_report()
    for options, message in (
        ({"audit_every": -1}, "audit_every >= 0"),
        ({"audit_every": 4, "audit_window": 0}, "window"),
        ({"audit_target": 0.0}, "audit_target > 0"),
        ({"audit_target": float("nan")}, "audit_target > 0"),
        ({"audit_every": 4, "mode": "exact"}, "nothing to audit"),
    ):
        with pytest.raises(ValueError, match=message):
            LocalMemory(1, D, **options)


def test_a_cut_that_fails_is_raised_and_started_again(monkeypatch):
    keys, values = _sharp_and_diffuse()
    memory = _memory(keys, values, audit_every=2, audit_window=128)
    queries = _queries(keys, 256)

    def failing(*args):
        raise RuntimeError("no memory for the cut")

    with monkeypatch.context() as patch:
        patch.setattr(index_memory, "_recut", failing)
        memory.attend(queries)  # a full window that misses: the cut starts, and fails
        built = int(memory._indexes[0].max_keys)
        with pytest.raises(RuntimeError, match="no memory for the cut"):
            memory.wait_for_index()
    assert int(memory._indexes[0].max_keys) == built  # the old pieces still answer
    assert memory.audit_report()[0]["audited"] == 128
    memory.attend(queries)  # still missing: the cut starts again
    memory.wait_for_index()
    assert int(memory._indexes[0].max_keys) == built // 2


def test_one_query_per_call_is_audited_once_in_every_calls():
    keys, values = _sharp_and_diffuse()
    memory = _memory(keys, values, audit_every=4)
    queries = _queries(keys, 10)
    out = torch.cat([memory.attend(queries[:, i : i + 1])[0] for i in range(10)], dim=1)
    g = make_geometry("dot", D)
    exact = [dense_attention(queries[:, i : i + 1], keys, values, g)[0] for i in (0, 4, 8)]
    errors = output_error(out[:, ::4], torch.cat(exact, dim=1)).double()
    for head, row in enumerate(memory.audit_report()):
        assert row["audited"] == 3
        assert row["err_median"] == pytest.approx(errors[head].median().item(), abs=1e-6)


def test_an_attend_does_not_wait_for_its_audit_unless_too_many_are_waiting():
    keys, values = _sharp_and_diffuse()
    memory = _memory(keys, values, audit_every=1, audit_target=10.0)
    queries = _queries(keys, AUDITS_WAITING + 1)
    release = threading.Event()
    index_memory._auditor().submit(release.wait)  # the audit thread held
    for row in range(AUDITS_WAITING):  # answered, their audits waiting
        memory.attend(queries[:, row : row + 1])
    assert len(memory._audits_under_way) == AUDITS_WAITING
    assert [row["audited"] for row in memory._audit.report()] == [0, 0]
    threading.Timer(0.2, release.set).start()
    memory.attend(queries[:, AUDITS_WAITING:])  # waits for the oldest audit, then goes on
    assert release.is_set()
    assert all(row["audited"] >= 1 for row in memory._audit.report())
    report = memory.audit_report()  # waits for the others
    assert [row["audited"] for row in report] == [AUDITS_WAITING + 1] * 2
    assert not memory._audits_under_way
