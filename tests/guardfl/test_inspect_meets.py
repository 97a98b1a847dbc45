"""Meets of two views of a client's updates on one batch (guardfl.inspect_meets, LeakHistory): the four-update
reads of threshold_bins' crossings, where no single update or difference of two reads anything."""

import torch

from guardfl import inspect_history
from guardfl.inspect_history import LeakHistory
from guardfl.inspect_meets import Views, frame, meet_reads, views_of

B, F, U = 16, 50, 8


def setup(seed=0):
    g = torch.Generator().manual_seed(seed)
    return g, torch.rand(B, F, generator=g), torch.arange(B) % 4


def bin_of(g, samples, units=U):
    """A bin's coefficients: its samples' mixes differ from unit to unit (a line through two samples, a plane
    through three), every coefficient in [0.5, 2] (no unit dominated by one sample)."""
    c = torch.zeros(B, units, dtype=torch.float64)
    for n in samples:
        c[n] = 0.5 + 1.5 * torch.rand(units, generator=g, dtype=torch.float64)
    return c


def reads(x, views):
    norms, gram = frame(x)
    new = views_of(views, norms)
    return meet_reads(Views(new.bases[1:], new.members[1:]), Views(new.bases[:1], new.members[:1]), norms, gram)


def test_two_lines_sharing_one_sample_meet_in_it_and_nothing_else_does():
    g, x, _ = setup()
    assert reads(x, [bin_of(g, [0, 1]), bin_of(g, [1, 2])]) == {1}
    assert reads(x, [bin_of(g, [0, 1, 2]), bin_of(g, [3, 1])]) == {1}  # a plane and a line
    assert reads(x, [bin_of(g, [0, 1, 2]), bin_of(g, [1, 2, 3])]) == set()  # a line in common: no point
    assert reads(x, [bin_of(g, [0, 1]), bin_of(g, [2, 3])]) == set()


def test_rounding_level_coefficients_on_every_sample_do_not_hide_the_meet():
    g, x, _ = setup(1)
    noise = lambda: 1e-8 * torch.randn(B, U, generator=g, dtype=torch.float64)  # noqa: E731
    assert reads(x, [bin_of(g, [0, 1]) + noise(), bin_of(g, [1, 2]) + noise()]) == {1}


def test_a_view_above_half_the_batch_is_not_kept():
    g, x, _ = setup()
    norms, _ = frame(x)
    assert len(views_of([bin_of(g, list(range(B // 2 + 1)), units=B)], norms).bases) == 0
    assert len(views_of([bin_of(g, [0, 1])], norms).bases) == 1


def rounds(g):
    """Three rounds on one batch: a base, then a line through samples 0 and 1 switched on, then one through 1 and
    2 (float32, as a model's coefficients are): the differences with the base meet in sample 1."""
    d0 = torch.randn(B, U, generator=g)
    return [d0, d0 + bin_of(g, [0, 1]).float(), d0 + bin_of(g, [1, 2]).float()]


def test_the_history_reads_where_the_differences_of_four_updates_meet_and_the_pairs_read_nothing():
    g, x, y = setup()
    history, seen = LeakHistory(), []
    for d in rounds(g):
        signals = {"fc": (d, x)}
        read, info = history.reads(x, y, signals)
        seen.append((sorted(read), info.get("read_by_differences", 0), info.get("read_by_meets", 0)))
        history.record(x, y, signals, read)
    assert seen == [([], 0, 0), ([], 0, 0), ([1], 0, 1)]


def answered(x, y, *coefficients):
    """A history that accepted one round of each of ``coefficients`` on the batch."""
    history = LeakHistory()
    for d in coefficients:
        history.record(x, y, {"fc": (d, x)}, history.reads(x, y, {"fc": (d, x)})[0])
    return history


def test_the_views_travel_with_a_saved_history():
    g, x, y = setup()
    d0, d1, d2 = rounds(g)
    history = answered(x, y, d0, d1)
    restored = LeakHistory.from_bytes(history.to_bytes())
    assert restored.reads(x, y, {"fc": (d2, x)})[1]["read_by_meets"] == 1


def test_a_layer_whose_input_changes_between_rounds_is_not_met():
    g, x, y = setup()
    history = LeakHistory()
    for r, d in enumerate(rounds(g)):
        signals = {"fc": (d, x + r)}
        read, info = history.reads(x, y, signals)
        history.record(x, y, signals, read)
    assert info["read_by_meets"] == 0


def test_views_past_what_a_batch_keeps_refuse_the_round(monkeypatch):
    g, x, y = setup()
    monkeypatch.setattr(inspect_history, "MEET_MAX_FLOATS", 70)
    d0, d1, d2 = rounds(g)
    history = answered(x, y, d0, d1)
    assert not history.reads(x, y, {"fc": (d0, x)})[1]["views_full"]  # the line kept and met again: 64 numbers
    assert history.reads(x, y, {"fc": (d2, x)})[1]["views_full"]


def test_where_two_views_share_a_line_and_a_third_cuts_it_the_history_reads_the_sample():
    """Bins {0, 1, 2}, {0, 1, 3} and {0, 2, 3, 4} switched on over a base round: every two share a line, no two
    meet in a point; the line the first two share cuts the third in sample 0 (the red team's crossings at
    depth 2, six updates combined)."""
    g, x, y = setup(3)
    d0 = torch.randn(B, U, generator=g)
    history, seen = LeakHistory(), []
    for d in [d0] + [d0 + bin_of(g, s).float() for s in ([0, 1, 2], [0, 1, 3], [0, 2, 3, 4])]:
        read, info = history.reads(x, y, {"fc": (d, x)})
        seen.append((sorted(read), info.get("read_by_meets", 0)))
        history.record(x, y, {"fc": (d, x)}, read)
    assert seen[:3] == [([], 0)] * 3 and seen[3] == ([0], 1)


def test_a_history_saved_before_it_kept_views_meets_them_again_from_its_rounds():
    import io

    g, x, y = setup()
    d0, d1, d2 = rounds(g)
    history = answered(x, y, d0, d1)
    plain = torch.load(io.BytesIO(history.to_bytes()), weights_only=True)
    for entry in plain["batches"].values():
        del entry["views"]
    buffer = io.BytesIO()
    torch.save(plain, buffer)
    restored = LeakHistory.from_bytes(buffer.getvalue())
    assert restored.reads(x, y, {"fc": (d2, x)})[1]["read_by_meets"] == 1


def test_honest_fedsgd_rounds_keep_no_view_and_meet_nothing():
    """Every honest update and every difference of honest rounds is full rank on the batch (the units' masks and
    the model's steps differ from sample to sample): nothing kept, nothing met, for free."""
    import torch.nn.functional as F

    from guardfl.inspect import inspect_model
    from guardfl.redteam.modality.image.models import FC2

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 3, 32, 32, generator=g), torch.arange(32) % 10
    torch.manual_seed(0)
    model, history = FC2(), LeakHistory()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(4):
        check = inspect_model(model, model, batch=(x, y), leak_limit=32, history=history).checks["leak_limit"]
        assert check["history"]["read_by_meets"] == 0
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    assert all(not v.bases for e in history._batches.values() for v in e.views.values())


def test_a_non_finite_view_is_not_examined_and_refuses_the_round():
    g, x, y = setup()
    d0, d1, _ = rounds(g)
    bad = d1.clone()
    bad[0, 0] = float("nan")
    assert answered(x, y, d0).reads(x, y, {"fc": (bad, x)})[1]["views_full"]
