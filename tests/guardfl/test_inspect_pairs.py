"""The isolation check's pairwise tests (``guardfl.inspect_pairs``): every nested pair of rows examined, the
bounds that spare the exact test never changing its outcome, and no cap a server can fill with decoys."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from guardfl.inspect import inspect_model
from guardfl.inspect_isolation import ISOLATION_PEEL, ISOLATION_READ_ERROR, ISOLATION_TOLERANCE, isolated_samples
from guardfl.inspect_pairs import nested_pairs, pair_sets
from guardfl.redteam.attacks.malicious.trap_chain import auto_rho, disguise
from guardfl.redteam.attacks.malicious.trap_weights import craft, trap_layers
from guardfl.redteam.modality.image.models import FC2
from tests import malicious as M


def exhaustive(d, inputs=None):
    """The pairwise tests written plainly, one nested pair at a time (the definition ``pair_sets`` must
    match): the separating pairs' held samples, and their count."""
    support = d.abs() > 1e-9 * d.abs().max()
    gram = None if inputs is None else inputs @ inputs.T
    held_sets, count = [], 0
    for i, j in nested_pairs(support, ISOLATION_PEEL).tolist():
        shared, held = support[:, j], support[:, i] & ~support[:, j]
        a, b = d[:, i] * shared, d[:, j] * shared
        c = (a @ b) / (b @ b)
        r = a - c * b
        ok = float(r.abs().sum()) <= ISOLATION_TOLERANCE * float(d[held, i].abs().min())
        if gram is not None:
            lead = float((d[held, i].abs() * gram.diagonal()[held].sqrt()).min())
            ok |= float(r @ gram @ r) ** 0.5 <= ISOLATION_READ_ERROR * lead
        if ok:
            count += 1
            held_sets.append(held)
    return held_sets, count


def decoys_and_chain(batch, decoys, levels, chain, seed, spread=0.0, tiny=False):
    """Coefficients (batch x units): ``levels`` groups of decoy rows that hold all but 1, 2, ... samples
    with random classifier columns (many nested pairs, none separating), then a chain of ``chain`` rows
    sharing one column (each bin one sample): what a server that fills a cap on pairs would send."""
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(batch, generator=g)
    units = decoys + chain
    support = torch.rand(batch, units, generator=g) < 0.8
    per = decoys // max(levels, 1)
    for level in range(levels):
        support[:, level * per:(level + 1) * per] = False
        support[order[level + 1:], level * per:(level + 1) * per] = True
    d = torch.randn(batch, 10, generator=g, dtype=torch.float64) @ torch.randn(10, units, generator=g, dtype=torch.float64)
    column = torch.randn(batch, generator=g, dtype=torch.float64)
    if tiny:
        column[order[-3:]] *= 1e-7  # the top samples barely held: a screen that loses them would miss them
    for k in range(chain):
        support[:, decoys + k] = False
        support[order[-(k + 1):], decoys + k] = True
        d[:, decoys + k] = column * (1 + k) * (1 + spread * torch.randn(batch, generator=g, dtype=torch.float64))
    return d * support


@settings(deadline=None, max_examples=40)
@given(st.integers(0, 2**16), st.integers(8, 48), st.integers(0, 6), st.integers(0, 24),
       st.sampled_from([0.0, 0.03, 0.2]), st.booleans(), st.booleans())
def test_the_screened_tests_find_exactly_what_the_exhaustive_tests_find(seed, batch, levels, chain, spread, tiny, with_inputs):
    d = decoys_and_chain(batch, 60, levels, min(chain, batch - 1), seed, spread, tiny)
    inputs = None
    if with_inputs:
        g = torch.Generator().manual_seed(seed + 1)
        inputs = torch.randn(batch, 40, generator=g, dtype=torch.float64) + (seed % 2) * 2.0  # centred or not
    want, count = exhaustive(d, inputs)
    support = d.abs() > 1e-9 * d.abs().max()
    gram = None if inputs is None else inputs @ inputs.T
    norms = None if gram is None else gram.diagonal().sqrt()[:, None]
    sets, info = pair_sets(d, support, gram, norms, ISOLATION_TOLERANCE, ISOLATION_READ_ERROR, ISOLATION_PEEL)
    assert info["separating_pairs"] == count
    assert sorted(map(tuple, sets.int().tolist())) == sorted(tuple(h.int().tolist()) for h in want)
    assert info["screened_pairs"] <= info["nested_pairs"] == nested_pairs(support, ISOLATION_PEEL).shape[0]


def test_every_nested_pair_is_examined_however_many_decoys_come_first():
    # 5 levels of 1,300 decoy rows: ~3.4 million nested pairs before the chain's (the old cap examined the
    # first 200,000 in row order and reported the rest)
    d = decoys_and_chain(64, 6500, 5, 12, seed=0)
    found, info = isolated_samples(d)
    assert info["nested_pairs"] > 3_000_000
    assert info["separating_pairs"] >= 11 and info["by_pairs"] >= 11
    assert "pairs_capped" not in info
    assert info["screened_pairs"] < 1000  # the decoys' pairs ruled out by their bounds, not tested one by one


def trap_behind_decoys():
    """FC-2 with 1,024 units on 64 normalised CIFAR-10 images: 1,016 disguised decoy rows in 5 levels at the
    bottom of one direction (370,894 nested pairs on the batch), then an 8-row trap (column noise 0.05)."""
    x, y = M.cifar(64, offset=4000)
    aux, _ = M.cifar(1000)
    shape = (3, 32, 32)
    torch.manual_seed(0)
    honest = FC2(shape, 10, hidden=1024)
    g = torch.Generator().manual_seed(0)
    trap = craft(honest, trap_layers(honest, shape), shape, aux, 1, 0.05, (float(aux.min()), float(aux.max())), g,
                 rows=8, samples=64)
    sent, chain = trap.sent, trap.chains[0]
    first, second = sent.net[1], sent.net[3]
    others = torch.tensor([u for u in range(1024) if u not in set(chain.tolist())])
    order = torch.cat([others, chain])  # the trap's rows last
    with torch.no_grad():
        first.weight.copy_(first.weight[order])
        first.bias.copy_(first.bias[order])
        second.weight.copy_(second.weight[:, order])
        v = torch.randn(first.in_features, generator=g, dtype=torch.float64)
        v /= v.norm()
        measure = aux.flatten(1).double() @ v
        per = len(others) // 5
        for level in range(5):
            cut = torch.quantile(measure, (level + 1) / 64.0)
            rows = torch.arange(level * per, (level + 1) * per)
            scale = 0.5 + torch.rand(per, generator=g, dtype=torch.float64)
            first.weight[rows] = (scale[:, None] * v[None, :]).float()
            first.bias[rows] = (-scale * (cut + 1e-7 * torch.randn(per, generator=g, dtype=torch.float64))).float()
    disguise(first.weight, auto_rho(), shape, aux, g)
    return sent, honest, (x, y)


def test_a_trap_behind_decoy_rows_that_filled_the_old_cap_is_refused():
    # before (the first 200,000 nested pairs examined in row order): passed, the pairwise count 0 (capped),
    # 3 samples by groups of rows (under 3.2), and the trap read 2 of the 64 images exactly
    sent, honest, batch = trap_behind_decoys()
    verdict = inspect_model(sent, honest, batch=batch)
    layer = verdict.checks["isolation"]["layers"]["net.1"]
    assert layer["nested_pairs"] > 200_000 and layer["by_pairs"] >= 4
    assert not verdict.ok and any(r.startswith("isolation: layer 'net.1'") for r in verdict.reasons), layer


@pytest.mark.parametrize("units", [64, 300])
def test_an_honest_layer_on_uncentred_inputs_finds_what_the_exhaustive_tests_find(units):
    g = torch.Generator().manual_seed(units)
    x = torch.rand(32, 48, generator=g, dtype=torch.float64)  # uncentred: many nested supports
    w = torch.randn(48, units, generator=g, dtype=torch.float64) / 48 ** 0.5
    d = (x @ w > 0).double() * (torch.randn(32, 10, generator=g, dtype=torch.float64)
                                 @ torch.randn(10, units, generator=g, dtype=torch.float64))
    found, info = isolated_samples(d, x)
    assert info["screened_pairs"] <= info["nested_pairs"]
    want, count = exhaustive(d, x)
    assert info["separating_pairs"] == count
