"""A malicious server against a client that encodes its inputs (MixUp, InstaHide): the server designs on its
own images encoded the same way, reads the encodings over many rounds and demixes them."""

import pytest
import torch

from guardfl.redteam.attacks import Setting, get
from guardfl.redteam.attacks.malicious import encoded_rounds
from guardfl.redteam.attacks.malicious.server import AUTO_REPEATS, MAX_REPEATS, fill_batch, repeats_for
from guardfl.redteam.auxdata import AuxData
from guardfl.redteam.client.simulate import FedSGD
from guardfl.redteam.modality.image.data import lfw_faces
from guardfl.redteam.modality.image.models import FC2
from guardfl.redteam.threat import ThreatModel

SHAPE = (1, 25, 25)
INSTAHIDE = {"kind": "instahide", "k": 4, "max_coeff": 0.65, "seed": 0}


@pytest.fixture(scope="module")
def faces():
    x, y = lfw_faces(10)
    return x[:32], y[:32], AuxData(x[64:], y[64:])


def test_rounds_are_sixteen_or_the_clients_budget():
    assert encoded_rounds.rounds_for(None) == encoded_rounds.ENCODED_ROUNDS == 16
    assert encoded_rounds.rounds_for(4) == 4 and encoded_rounds.rounds_for(10**6) == MAX_REPEATS
    # noise on top of an encoding: each round's reads are of other encodings, so rounds are collected, not averaged
    stack = {"kind": "stack", "defenses": [INSTAHIDE, {"kind": "gaussian", "sigma": 0.01}]}
    assert repeats_for(stack, "auto") == 1 and repeats_for({"kind": "gaussian", "sigma": 0.01}, "auto") == AUTO_REPEATS


def test_the_server_encodes_its_own_images_with_its_own_randomness(faces):
    _, _, aux = faces
    from guardfl.defenses import parse_config

    config = parse_config(INSTAHIDE)  # the client's seed (0) is never the server's
    one = encoded_rounds.encoded_aux(aux, config, 10, seed=1)
    again = encoded_rounds.encoded_aux(aux, config, 10, seed=1)
    other = encoded_rounds.encoded_aux(aux, config, 10, seed=2)
    assert one.images.shape == aux.images.shape and one.labels.dtype == torch.long
    assert torch.equal(one.images, again.images) and not torch.equal(one.images, other.images)
    assert float(one.images.min()) < 0 < float(one.images.max())  # InstaHide's signs: [-1, 1]
    # the configuration's seed is replaced by the server's: whatever the client's seed, the same encodings
    assert torch.equal(encoded_rounds.encoded_aux(aux, parse_config({**INSTAHIDE, "seed": 7}), 10, seed=1).images, one.images)
    assert encoded_rounds.encoded_aux(None, config, 10, seed=1) is None


def test_distinct_reads_drop_copies_and_the_grey_placeholder(faces):
    x = faces[0]
    filled = fill_batch(x[:3], 8, (0.0, 1.0))
    assert torch.equal(encoded_rounds.distinct_reads(filled), x[:3])
    assert encoded_rounds.distinct_reads(fill_batch(x[:0], 8, (0.0, 1.0))).shape[0] == 0


@pytest.mark.parametrize("attack", ["threshold_bins", "sign_bits", "fishing"])
def test_constructions_that_combine_rounds_are_not_applicable_against_a_known_encoding(faces, attack):
    aux = faces[2]
    setting = Setting(FC2(SHAPE, 10), FedSGD(), 32, SHAPE, 10, (0.0, 1.0), INSTAHIDE)
    known = ThreatModel(server="malicious", labels="known", aux=aux)
    assert "encodes its inputs afresh every round" in get(attack).applicable(setting, known)
    assert get("trap_weights").applicable(setting, known) is None
    assert get("robbing_the_fed").applicable(setting, known) is None
    unknown = ThreatModel(server="malicious", labels="known", aux=aux, defense="unknown")
    reason = get(attack).applicable(setting, unknown)
    assert reason is None or "encodes" not in reason
