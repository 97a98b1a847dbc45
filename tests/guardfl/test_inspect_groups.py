"""The isolation check's group test (issue 34, ``guardfl.inspect_groups``): samples a server reads from a
combination of several rows that share a support, where no one row or pair of rows reads anything."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import guardfl.inspect_groups as groups
import guardfl.inspect_isolation as isolation
from guardfl.inspect import inspect_model, isolated_samples
from guardfl.inspect_groups import group_sets
from guardfl.redteam.attacks.malicious.trap_chain import auto_rho, disguise
from guardfl.redteam.attacks.malicious.trap_weights import craft, trap_layers
from guardfl.redteam.modality.image.models import FC2
from tests import malicious as M


def grouped_delta(batch=16, cuts=12, k=2, classes=10, seed=0):
    """Coefficients of a chain whose cuts hold ``k`` rows each, every row its own column from a ``k``-dim
    subspace: row (j, l) holds the samples above cut j with coefficient ``c_jl . e_n`` (batch x rows)."""
    g = torch.Generator().manual_seed(seed)
    s = torch.rand(batch, generator=g, dtype=torch.float64)
    e = torch.randn(batch, classes, generator=g, dtype=torch.float64)  # each sample's logit gradient
    basis = torch.randn(k, classes, generator=g, dtype=torch.float64)
    cut = torch.linspace(-0.1, 0.95, cuts, dtype=torch.float64)
    cols = torch.randn(cuts, k, k, generator=g, dtype=torch.float64) @ basis  # cuts x k x classes
    above = (s[:, None] > cut[None, :]).double()  # batch x cuts
    delta = above[:, :, None] * torch.einsum("nc,jlc->njl", e, cols)
    return delta.reshape(batch, cuts * k), s, cut


def alone_in_bin(s, cut):
    bins = torch.bucketize(s, cut)
    return [n for n in range(len(s)) if int((bins == bins[n]).sum()) == 1]


def test_two_rows_per_cut_with_their_own_columns_read_what_pairs_of_rows_do_not():
    delta, s, cut = grouped_delta()
    sets, info = group_sets(delta, delta.abs() > 0, None, None, 0.1, 0.25, 4)
    assert info["row_groups"] >= 2 and info["separating_groups"] >= 1  # cuts with no sample between them merge
    found, counts = isolated_samples(delta)
    alone = alone_in_bin(s, cut)
    assert alone and set(alone) <= set(found) and counts["separating_groups"] >= 1


def test_without_the_group_test_pairs_of_rows_read_only_where_a_bin_shares_one_sample(monkeypatch):
    # near the top of the measurement two rows share one sample, and one factor cancels it: the rest of the
    # bins need the group
    delta, s, cut = grouped_delta(batch=32, cuts=24)
    monkeypatch.setattr(isolation, "group_sets", lambda d, *a: (torch.zeros(0, d.shape[0], dtype=torch.bool), {}))
    assert len(isolation.isolated_samples(delta)[0]) < len(alone_in_bin(s, cut))


@settings(deadline=None, max_examples=20)
@given(st.integers(0, 2**16), st.integers(2, 4))
def test_every_sample_alone_in_its_bin_is_counted_whatever_k(seed, k):
    delta, s, cut = grouped_delta(batch=20, cuts=10, k=k, seed=seed)
    perm = torch.randperm(delta.shape[1], generator=torch.Generator().manual_seed(seed))
    assert set(alone_in_bin(s, cut)) <= set(isolated_samples(delta[:, perm])[0])


@settings(deadline=None, max_examples=20)
@given(st.integers(0, 2**16))
def test_dense_random_coefficients_still_isolate_nothing(seed):
    g = torch.Generator().manual_seed(seed)
    delta = torch.randn(32, 64, generator=g, dtype=torch.float64) * (torch.rand(32, 64, generator=g) < 0.5)
    assert isolated_samples(delta)[0] == []


def test_a_group_alone_reads_nothing_a_server_could_not_unmix():
    # three rows holding the same three samples with independent coefficients: the server knows its columns,
    # not the batch's coefficients, and no combination it can choose cancels two unknown samples
    delta = torch.tensor([[1.0, 2.0, 0.5], [0.3, -1.0, 2.0], [2.0, 0.1, -0.7]], dtype=torch.float64)
    assert isolated_samples(delta)[0] == []


def test_single_row_pairs_are_left_to_the_pairwise_tests():
    delta = torch.tensor([[1.0, 0.0], [1.0, 2.0], [1.0, 2.0]], dtype=torch.float64)
    _, info = group_sets(delta, delta.abs() > 0, None, None, 0.1, 0.25, 4)
    assert info["row_groups"] == 0 and info["separating_groups"] == 0


@pytest.mark.parametrize("per_cut", [2, 3])
def test_inspect_model_refuses_the_grouped_trap_on_a_centred_batch(per_cut):
    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(64, 1, 16, 16, generator=g) - 0.5, torch.arange(64) % 10
    aux = torch.rand(64, 1, 16, 16, generator=g) - 0.5
    model = FC2((1, 16, 16), 10)
    trap = craft(model, trap_layers(model, (1, 16, 16)), (1, 16, 16), aux, 2, 0.0, (-0.5, 0.5), g, samples=64, per_cut=per_cut)
    disguise(trap.rows(), auto_rho(), (1, 16, 16), aux, g)
    inspection = inspect_model(trap.sent, model, batch=(x, y))
    assert not inspection.ok and any(r.startswith("isolation:") for r in inspection.reasons)
    layer = inspection.checks["isolation"]["layers"]["net.1"]
    assert layer["separating_groups"] > 0 and layer["row_groups"] > 0


def test_a_layer_past_the_cap_of_group_pairs_is_refused(monkeypatch):
    """Fail closed: decoy groups past the cap could hide a trap's, so a layer with more is refused (here an
    honest FC-2 on inputs in [0, 1], whose units firing for every sample form a group, with the cap at 0)."""
    import guardfl.inspect as inspect_module

    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(64, 1, 16, 16, generator=g), torch.arange(64) % 10
    torch.manual_seed(0)
    model = FC2((1, 16, 16), 10)
    assert inspect_model(model, model, batch=(x, y)).ok
    monkeypatch.setattr(groups, "GROUP_MAX_PAIRS", 0)
    monkeypatch.setattr(inspect_module, "GROUP_MAX_PAIRS", 0)
    found = inspect_model(model, model, batch=(x, y))
    assert found.checks["isolation"]["layers"]["net.1"]["groups_capped"] == 1
    assert not found.ok and any("past what is examined" in r for r in found.reasons)


@settings(deadline=None, max_examples=25)
@given(st.integers(0, 2**16), st.integers(2, 4), st.sampled_from([6, 12, 32]), st.sampled_from([0.0, 0.02, 0.3]),
       st.booleans(), st.booleans())
def test_group_pairs_tested_together_find_what_they_find_one_by_one(seed, k, batch, noise, uncentred, with_inputs):
    """``_separates`` on small group pairs batched and padded, against each pair alone at its own width on a grouped
    chain with noisy coefficients next to honest units firing on inputs centred or not."""
    g = torch.Generator().manual_seed(seed)
    chain, _, _ = grouped_delta(batch=batch, cuts=10, k=k, seed=seed)
    chain = chain * (1 + noise * torch.randn(chain.shape, generator=g, dtype=torch.float64))
    x = torch.rand(batch, 30, generator=g, dtype=torch.float64) + (1.0 if uncentred else -0.5)
    fires = x @ torch.randn(30, 200, generator=g, dtype=torch.float64) > 3 * torch.randn(200, generator=g, dtype=torch.float64)
    honest = fires.double() * (torch.randn(batch, 10, generator=g, dtype=torch.float64)
                               @ torch.randn(10, 200, generator=g, dtype=torch.float64))
    d = torch.cat([chain, honest], 1)
    support = d.abs() > 1e-9 * d.abs().max()
    gram = x @ x.T if with_inputs else None
    norms = None if gram is None else gram.diagonal().sqrt()[:, None]
    together, info = group_sets(d, support, gram, norms, 0.1, 0.25, 4)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(groups, "BATCH_ROWS", 0)  # every pair one by one
        alone, info_alone = group_sets(d, support, gram, norms, 0.1, 0.25, 4)
    assert sorted(map(tuple, together.int().tolist())) == sorted(map(tuple, alone.int().tolist()))
    assert info == info_alone


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_an_honest_wide_layer_on_a_small_uncentred_batch_is_not_refused(seed):
    """Until 2026-11-27 the cap on group pairs was 2,000, and the honest FC-2 with 1,024 units on 8 CIFAR-10
    images in [0, 1] had 2,000-2,300 (its units firing for all but a few images form groups): refused, 3 of
    3 seeds. The cap was 50,000 then, 200,000 since isolation examines 8,192 units (benign measured up to
    13,394 with 4,096 units, 41,302 with 8,192)."""
    x, y = M.cifar(8, offset=2000 + 8 * seed)
    x = x * M.CIFAR_STD + M.CIFAR_MEAN
    torch.manual_seed(seed)
    model = FC2((3, 32, 32), 10, hidden=1024)
    found = inspect_model(model, model, batch=(x, y))
    assert found.checks["isolation"]["layers"]["net.1"]["groups_capped"] == 0
    assert found.ok, found.reasons


def wide_groups(batch, rows, classes, seed):
    """A group of ``rows`` rows firing for the whole batch, and as many single rows that each miss one or
    two samples (nested under it): coefficients of rank ``classes`` (an honest layer's, each sample's logit
    gradient through a random column) or full rank (None)."""
    g = torch.Generator().manual_seed(seed)
    support = torch.ones(batch, 2 * rows, dtype=torch.bool)
    for j in range(rows):
        support[torch.randperm(batch, generator=g)[:1 + j % 2], rows + j] = False
    if classes is None:
        d = torch.randn(batch, 2 * rows, generator=g, dtype=torch.float64)
    else:
        d = torch.randn(batch, classes, generator=g, dtype=torch.float64) @ torch.randn(classes, 2 * rows, generator=g,
                                                                                         dtype=torch.float64)
    return d * support


@settings(deadline=None, max_examples=25)
@given(st.integers(0, 2**16), st.sampled_from([6, 12, 32]), st.sampled_from([12, 40, 90]), st.sampled_from([None, 3, 10]),
       st.booleans())
def test_wide_group_pairs_tested_at_the_batch_width_find_what_their_rows_find(seed, batch, rows, classes, with_inputs):
    """A pair of groups with more rows than the batch has samples is tested through ``_factor`` (the batch's
    width: the same combinations' vectors at the same norms), against its rows themselves, on large groups
    next to a grouped chain (a server's decoys, or an honest layer's units firing for every sample)."""
    g = torch.Generator().manual_seed(seed)
    chain, _, _ = grouped_delta(batch=batch, cuts=6, k=3, seed=seed)
    d = torch.cat([wide_groups(batch, rows, classes, seed), chain], 1)
    support = d.abs() > 1e-9 * d.abs().max()
    x = torch.randn(batch, 30, generator=g, dtype=torch.float64)
    gram = x @ x.T if with_inputs else None
    norms = None if gram is None else gram.diagonal().sqrt()[:, None]
    factored, info = group_sets(d, support, gram, norms, 0.1, 0.25, 4)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(groups, "_factor", lambda f: f)  # every pair at its own width
        rows_themselves, info_rows = group_sets(d, support, gram, norms, 0.1, 0.25, 4)
    assert sorted(map(tuple, factored.int().tolist())) == sorted(map(tuple, rows_themselves.int().tolist()))
    assert info == info_rows


def test_a_server_s_large_groups_cost_a_solve_at_the_batch_width():
    """A group of 800 rows firing for all 64 samples and 800 single rows nested under it: ~700 pairs of 801
    rows (some singles share a support), each one solve of that size until 2026-11-27 (7.7 s for this
    layer, 92 s at 1,600 + 1,600 rows: a server could stall the inspection for minutes), one of at most 64
    now. Counted, not timed: the widths solved."""
    d = wide_groups(64, 800, None, 0)
    support = d.abs() > 0
    widths = []
    real = groups._separates

    def spy(full, *args, **kwargs):
        widths.append(full.shape[2])
        return real(full, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(groups, "_separates", spy)
        sets, info = group_sets(d, support, None, None, 0.1, 0.25, 4)
    assert info["separating_groups"] > 0 and max(widths) <= 64
