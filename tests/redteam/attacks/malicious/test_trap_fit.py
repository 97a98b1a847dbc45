"""``trap_weights rows: fit``: the trap sized on a shadow of the client (its inspection with the server's margin,
its defense without the seeds), on the attacker's own images."""

import torch

from guardfl.defenses import parse_config
from guardfl.redteam.attacks import Setting, get
from guardfl.redteam.attacks.malicious.trap_fit import FIT_BATCHES, FIT_GROUPED, FIT_SIZES, shadow_data, sizes, unseeded
from guardfl.redteam.auxdata import AuxData
from guardfl.redteam.client.simulate import ClientQuery, FedAvg, FedSGD
from guardfl.redteam.modality.image import metrics
from guardfl.redteam.modality.image.models import FC2
from guardfl.redteam.threat import ThreatModel

SHAPE = (3, 16, 16)  # small images: the fit builds and inspects ~16 traps on 4 shadow batches
CENTRED = (-0.5 / 0.29, 0.5 / 0.29)  # uniform images, centred and scaled to unit variance


def batch(n, seed, centred=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, *SHAPE, generator=g)
    return ((x - 0.5) / 0.29 if centred else x), torch.arange(n) % 10


def setup(centred, n=32):
    torch.manual_seed(0)
    model = FC2(SHAPE)
    aux = AuxData(batch(5 * n, 9, centred)[0], torch.arange(5 * n) % 10)
    rng = CENTRED if centred else (0.0, 1.0)
    return model, Setting(model, FedSGD(), n, SHAPE, 10, rng, None), ThreatModel(server="malicious", labels="known", aux=aux)


def exact(rec, x, rng):
    return sum(row["ssim"] > 0.9 for row in metrics.evaluate(rec, x, data_range=rng)["per_image"])


def test_sizes_start_with_the_whole_layer_and_fit_the_layer_and_the_cuts():
    assert sizes("top", 2, 256) == [(2, None, None), *[(k, r, None) for k, r in FIT_SIZES]]
    assert (16, 4, None) not in sizes("top", 2, 32) and (2, None, None) in sizes("top", 2, 32)
    assert sizes("top", 2, 256, grouped=True)[len(FIT_SIZES) + 1:] == list(FIT_GROUPED)
    assert (8, 3, 2) not in sizes("top", 2, 32, grouped=True) and (2, None, 4) in sizes("top", 2, 32, grouped=True)
    middle = sizes("middle", 2, 256)
    assert all(rows is not None and rows >= 2 for _, rows, _ in middle + sizes("middle", 2, 256, grouped=True))  # a median trap's bin lies between two cuts


def test_the_shadow_draws_its_own_defense_randomness():
    stack = {"kind": "stack", "defenses": [{"kind": "gaussian", "sigma": 0.1, "seed": 3}, {"kind": "gradprune", "ratio": 0.9, "seed": 4}]}
    dumped = unseeded(stack).model_dump(mode="json")
    assert all(member.get("seed") is None for member in dumped["defenses"])
    assert unseeded({"kind": "gaussian", "sigma": 0.1, "seed": 3}) == parse_config({"kind": "gaussian", "sigma": 0.1})
    assert unseeded(None) is None


def test_the_shadow_batches_are_as_large_as_the_clients_and_held_out_where_the_aux_data_allows():
    images = torch.rand(330, *SHAPE)
    aux = AuxData(images, torch.zeros(330, dtype=torch.long))
    held, how = shadow_data(aux, 64)
    assert len(held) == FIT_BATCHES and "held out" in how
    assert all(torch.equal(b.images, images[64 * (i + 1):64 * (i + 2)]) for i, b in enumerate(held))  # never the calibration's first 64
    few, how = shadow_data(AuxData(images[:36], torch.zeros(36, dtype=torch.long)), 64)
    assert len(few) == 1 and len(few[0].images) == 64 and "28 of them mirrored" in how
    assert torch.equal(few[0].images[36:], images[:28].flip(-1))
    assert shadow_data(None, 64) == ([], "")


def test_against_a_client_that_does_not_inspect_the_fit_takes_what_reads_most():
    model, setting, threat = setup(centred=False)
    x, y = batch(32, 0)
    # bins alone (no peeling): a whole layer (one chain of 2 rows per cut read most here: 24.5 exact per shadow batch)
    rec = get("trap_weights", seed=0, rows="fit", peel=False).interrogate(ClientQuery(x, y, None, FedSGD()), setting, threat)
    assert rec.info["rows"].startswith("all (fit on 4 batches of 32 auxiliary samples, held out from the calibration: ")
    assert " x all" in rec.info["rows"].split(": ")[1].split(",")[0]
    assert exact(rec, x, (0.0, 1.0)) >= 16 and rec.info["checked"] == 0
    # peeled (the default), the shadows read all 32 of their faces with many sizes (1 x 1, 4 x 2, 8 x 6, ...);
    # the tie goes to the most rows (12 x 6), not to finer digits of the SSIM that package versions move: the
    # single row reads 14 of this batch, 12 x 6 all 32
    rec = get("trap_weights", seed=0, rows="fit").interrogate(ClientQuery(x, y, None, FedSGD()), setting, threat)
    assert rec.info["rows"].split(": ", 1)[1].startswith("12 x 6, 32 exact"), rec.info["rows"]
    assert exact(rec, x, (0.0, 1.0)) >= 30 and rec.info["checked"] >= 30


def test_on_a_centred_batch_the_fit_finds_a_trap_the_inspection_lets_through_where_a_fixed_size_is_refused():
    """Centred inputs: the honest FC-2 isolates nothing, so the isolation check flags 2 samples; 8 chains of 6
    rows are refused (and the certificate still says what was sent), the fitted trap reads at most the one
    sample the count lets through (docs/research/malicious-server.md, section 11). It sends 2 single rows, which pass
    every shadow batch; since the count peels every row's support (2026-11-28, section 15) they count 2 on
    this client's batch and are refused there too."""
    model, setting, threat = setup(centred=True)
    x, y = batch(32, 0, centred=True)
    client = ClientQuery(x, y, None, FedSGD(), inspect=True, reference=model, input_range=CENTRED)
    fixed = get("trap_weights", seed=0, chains=8, rows=6).interrogate(client, setting, threat)
    assert fixed.info["refused"].startswith("isolation:") and fixed.info["rows"] == "6"
    assert fixed.info["malicious_model"] is not None  # the model sent, on record though refused
    fitted = get("trap_weights", seed=0, rows="fit").interrogate(client, setting, threat)
    line = fitted.info["rows"]
    assert line.startswith("1 (fit on 4 batches of 32 auxiliary samples, held out from the calibration: 2 x 1, 1 exact")
    assert "8 x 6 (refused 4)" in line and "2 x all (refused 4)" in line
    assert fitted.info["refused"].startswith("isolation: layer 'net.1' singles out 2 of 32") and client.refused == 2
    assert exact(fitted, x, CENTRED) <= 1


def test_against_a_fedavg_client_the_shadow_inspects_the_first_local_batch_as_the_client_does(monkeypatch):
    """A FedAvg client inspects a received model on its first local step's batch, not on all its samples:
    the shadow's inspection runs on the same share of its own batch (``first_batch``)."""
    import guardfl.redteam.attacks.malicious.trap_fit as trap_fit

    model, setting, threat = setup(centred=False)
    setting = Setting(model, FedAvg(epochs=1, batch_size=8, lr=0.1), 32, SHAPE, 10, (0.0, 1.0), None)
    x, y = batch(32, 0)
    seen = []
    real = trap_fit.inspect_model
    monkeypatch.setattr(trap_fit, "inspect_model", lambda *a, **k: seen.append(len(k["batch"][0])) or real(*a, **k))
    client = ClientQuery(x, y, None, FedAvg(epochs=1, batch_size=8, lr=0.1), inspect=True, reference=model)
    rec = get("trap_weights", seed=0, rows="fit").interrogate(client, setting, threat)
    assert seen and set(seen) == {8}
    assert rec.info["rows"].split()[0] != "all" and "fit on 4 batches of 32" in rec.info["rows"]


def test_the_shadow_runs_the_clients_defense_only_where_the_threat_makes_it_known():
    from guardfl.redteam.attacks.malicious.trap_fit import shadows

    model, setting, threat = setup(centred=False)
    x, y = batch(32, 0)
    client = ClientQuery(x, y, {"kind": "gaussian", "sigma": 0.1, "seed": 5}, FedSGD())
    known, _ = shadows(client, setting, threat.aux, known=True)
    assert known[0][0].defense_config == parse_config({"kind": "gaussian", "sigma": 0.1})  # its own noise
    unknown, what = shadows(client, setting, threat.aux, known=False)
    assert unknown[0][0].defense_config is None and what.endswith("the client's defense unknown: none run")


def test_the_auxiliary_basis_is_kept_for_the_same_images_and_recomputed_when_they_change():
    from guardfl.redteam.attacks.malicious import trap_chain

    images = torch.rand(20, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    first = trap_chain.aux_basis(images)
    assert trap_chain.aux_basis(images) is first  # one SVD per attack
    images.mul_(0.5).add_(torch.rand(20, 1, 8, 8, generator=torch.Generator().manual_seed(1)))  # changed in place
    changed = trap_chain.aux_basis(images)
    assert changed is not first and not torch.allclose(changed.abs(), first.abs())
    assert trap_chain.aux_basis(images) is changed
    other = trap_chain.aux_basis(images.clone())  # equal values, another tensor: computed anew, the same basis
    assert other is not changed and torch.allclose(other.abs(), changed.abs())
