"""Feature hashing (count-sketch) of observations, whole rows or block by block."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from guardfl.redteam import FedAvg, FedSGD
from guardfl.redteam.client.hashing import CountSketch
from guardfl.redteam.client.transmit import TransmitSimulator
from guardfl.redteam.modality.image.data import lfw_faces
from guardfl.redteam.modality.image.models import LeNetZhu, set_model_state
from guardfl.redteam.modality.text.models import next_token_labels, text_classifier


@given(seed=st.integers(0, 2**31), n=st.integers(1, 5))
def test_count_sketch_is_a_fixed_linear_map(seed, n):
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(n, 300, generator=g), torch.randn(n, 300, generator=g)
    cs = CountSketch(300, 40, seed=seed)
    torch.testing.assert_close(cs(a + 2 * b), cs(a) + 2 * cs(b), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cs(a), CountSketch(**cs.spec())(a))
    assert cs(a).shape == (n, 40)
    # an unsigned sketch sums the bins: total mass is preserved
    un = CountSketch(300, 40, seed=seed, signed=False)
    torch.testing.assert_close(un(a).sum(1), a.sum(1), atol=1e-4, rtol=1e-4)


@given(seed=st.integers(0, 2**31), n=st.integers(1, 4), cuts=st.lists(st.integers(1, 299), max_size=6, unique=True),
       signed=st.booleans())
def test_of_parts_is_the_sketch_of_the_concatenated_rows_bit_for_bit(seed, n, cuts, signed):
    """Any split into column blocks hashes to exactly what the whole rows hash to (the same sums in the
    same order), and the blocks are consumed."""
    rows = torch.randn(n, 300, generator=torch.Generator().manual_seed(seed))
    cs = CountSketch(300, 37, seed=seed, signed=signed)
    edges = [0, *sorted(cuts), 300]
    parts = [rows[:, a:b].clone() for a, b in zip(edges, edges[1:])]
    assert torch.equal(cs.of_parts(parts), cs(rows))
    assert parts == []


@pytest.mark.parametrize("blocks", [[100, 150], [100, 250], []])
def test_of_parts_refuses_blocks_that_do_not_cover_the_input(blocks):
    cs = CountSketch(300, 10, seed=0)
    with pytest.raises(ValueError, match="of_parts"):
        cs.of_parts([torch.randn(2, k) for k in blocks])


@pytest.mark.parametrize("protocol", [FedSGD(), FedAvg(epochs=1, batch_size=1, lr=0.05, momentum=0.9)])
@pytest.mark.parametrize("defense", [None, {"kind": "gradprune", "ratio": 0.7}, {"kind": "gaussian", "sigma": 0.1}])
def test_simulator_blocks_hash_to_the_rows_hash(protocol, defense):
    """What the learned inversions hash: the simulator's per-parameter blocks (never concatenated) give
    the sketch of its full rows, defense draws included (two simulators on the same attacker seed)."""
    x, y = lfw_faces(10)
    lenet = set_model_state(LeNetZhu((1, 25, 25), 10), "wide-init", seed=0)
    xb, yb = x[:4].view(2, 2, 1, 25, 25), y[:4].view(2, 2)
    rows_sim = TransmitSimulator(lenet, defense, protocol, chunk=1, seed=5)
    parts_sim = TransmitSimulator(lenet, defense, protocol, chunk=1, seed=5)
    cs = CountSketch(rows_sim.dim, 500, seed=1)
    want = torch.cat([cs(r) for r in rows_sim.chunks(xb, yb)])
    got = parts_sim.updates(xb, yb, cs)  # what the learned inversions call
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_simulator_blocks_of_a_language_model():
    model = text_classifier(vocab_size=300, num_classes=2)
    ids = torch.randint(0, 300, (3, 2, 8), generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, 2, (3, 2), generator=torch.Generator().manual_seed(1))
    sim = TransmitSimulator(model, {"kind": "sign"}, FedSGD(), chunk=2)
    cs = CountSketch(sim.dim, 64, seed=2)
    want = torch.cat([cs(r) for r in sim.chunks(ids, labels)])
    got = sim.updates(ids, labels, cs)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    assert next_token_labels(ids[0]).shape == ids[0].shape
