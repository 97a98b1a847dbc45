"""Trap weights (the adaptive malicious server of issue 34): Robbing the Fed's bins inside the honest first
layer, disguised against inspect_model's weight checks; the client's inspection in ClientQuery."""

from dataclasses import replace

import pytest
import torch

from guardfl.inspect import inspect_model
from guardfl.redteam.modality.image import metrics
from guardfl.redteam.attacks import Setting, get
from guardfl.redteam.auxdata import AuxData
from guardfl.redteam.client.simulate import ClientQuery, FedSGD, ModelRefused
from guardfl.redteam.modality.image.models import FC2, LeNetZhu
from guardfl.redteam.threat import ThreatModel

SHAPE = (3, 32, 32)


def batch(n=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, *SHAPE, generator=g), torch.arange(n) % 10


def setup(n=32):
    torch.manual_seed(0)
    model = FC2()
    aux = AuxData(batch(512, seed=9)[0], torch.zeros(512, dtype=torch.long))
    return model, Setting(model, FedSGD(), n, SHAPE, 10, (0.0, 1.0), None), ThreatModel(server="malicious", labels="known", aux=aux)


def exact(rec, x):
    return sum(row["ssim"] > 0.9 for row in metrics.evaluate(rec, x)["per_image"])


def test_applicable_to_a_first_linear_layer_only_with_the_reason_elsewhere():
    _, setting, threat = setup()
    assert get("trap_weights").applicable(setting, threat) is None
    lenet = Setting(LeNetZhu(), FedSGD(), 4, SHAPE, 10, (0.0, 1.0), None)
    assert "first layer is Conv2d" in get("trap_weights").applicable(lenet, threat)
    assert "threat.server: malicious" in get("trap_weights").applicable(setting, ThreatModel())


def test_reads_most_of_an_undefended_batch_exactly():
    model, setting, threat = setup()
    x, y = batch()
    rec = get("trap_weights", seed=0).interrogate(ClientQuery(x, y, None, FedSGD()), setting, threat)
    assert exact(rec, x) >= 16 and rec.info["queries"] == 1 and rec.info["refused_queries"] == 0


def test_the_crafted_model_passes_the_weight_checks_it_was_built_against():
    """No imprint, duplicate-row, fishing or architecture reason; a chain's rows are near multiples of each
    other (the near-parallel-rows check) until each gets a part the inputs barely see (``disguise``)."""
    model, setting, threat = setup()
    x, y = batch()
    rec = get("trap_weights", seed=0).interrogate(ClientQuery(x, y, None, FedSGD()), setting, threat)
    sent = rec.info["malicious_model"]
    assert list(sent.state_dict()) == list(model.state_dict())  # the honest architecture
    assert [r.split(":")[0] for r in inspect_model(sent.state_dict(), model).reasons] == ["parallel rows"]
    assert rec.info["disguised"] == "none"  # disguise: auto leaves the whole layer as it is
    disguised = get("trap_weights", seed=0, disguise=0.15).interrogate(ClientQuery(x, y, None, FedSGD()), setting, threat)
    assert inspect_model(disguised.info["malicious_model"].state_dict(), model).ok
    assert disguised.info["disguised"] == "256 rows, rho 0.15"


def test_an_inspecting_client_refuses_the_whole_layer_trap_and_sends_nothing():
    model, setting, threat = setup()
    x, y = batch()
    client = ClientQuery(x, y, None, FedSGD(), inspect=True, reference=model)
    rec = get("trap_weights", seed=0, column_noise=0).interrogate(client, setting, threat)
    assert rec.info["refused"].startswith("parallel rows:") and "shared columns:" in rec.info["refused"]
    # uniform images in [0, 1]: the honest FC-2 at a fresh initialisation singles out half the batch by
    # itself, and the trap's whole batch is within chance of that, so isolation does not judge it
    assert "isolation:" not in rec.info["refused"] and rec.info["refused_queries"] == 1
    # calibrated against the shared-columns check, the columns' noise also breaks the cancellations the
    # isolation check counts; the chains' rows still repeat one direction
    assert get("trap_weights", seed=0).interrogate(client, setting, threat).info["refused"].startswith("parallel rows:")
    assert exact(rec, x) == 0 and torch.allclose(rec.inputs, torch.full_like(rec.inputs, 0.5))


def test_a_small_trap_passes_the_inspection_and_still_reads_samples():
    """The construction adapted to the isolation check: a few rows at the top of one measurement."""
    model, setting, threat = setup()
    x, y = batch()
    client = ClientQuery(x, y, None, FedSGD(), inspect=True, reference=model)
    rec = get("trap_weights", seed=0, chains=1, rows=4).interrogate(client, setting, threat)
    assert "refused" not in rec.info and rec.info["candidates"] >= 1
    assert metrics.evaluate(rec, x)["per_image"] and max(r["ssim"] for r in metrics.evaluate(rec, x)["per_image"]) > 0.9


def test_small_trap_keeps_the_honest_rows():
    model, setting, threat = setup()
    x, y = batch()
    rec = get("trap_weights", seed=0, chains=1, rows=4).interrogate(ClientQuery(x, y, None, FedSGD()), setting, threat)
    sent = rec.info["malicious_model"].state_dict()["net.1.weight"]
    same = (sent == model.state_dict()["net.1.weight"]).all(dim=1)
    assert int(same.sum()) == 256 - 4


def test_inspection_needs_a_reference():
    x, y = batch(4)
    with pytest.raises(Exception, match="reference"):
        ClientQuery(x, y, None, FedSGD(), inspect=True)


def test_model_refused_names_the_reasons():
    err = ModelRefused(["isolation: a", "architecture: b"])
    assert err.reasons == ["isolation: a", "architecture: b"] and "isolation: a; architecture: b" in str(err)


# -- adapted to SEER's D-SNR check (cuts: middle) ---------------------------------------------------------------
PRUNE = {"kind": "gradprune", "ratio": 0.9}


def dsnr_of(kw, seed, x, y, model, setting, threat):
    rec = get("trap_weights", seed=seed, **kw).interrogate(ClientQuery(x, y, PRUNE, FedSGD()), setting, threat)
    found = inspect_model(rec.info["malicious_model"], model, batch=(x, y), disaggregation=True)
    return found.checks["disaggregation"]["max"], found


def test_boosted_rows_at_the_top_let_one_sample_dominate_and_around_the_median_they_do_not():
    """Boosted trap rows at the top of the measurement send a few samples' gradients 1000x: one of them can
    carry more than twice all the others' (D-SNR > 2, refused); around the median half the batch fires the
    boosted rows and no sample dominates (measured on FC-2 / CIFAR-10 batches of 64: 0.05-0.21)."""
    model, setting, threat = setup()
    setting = replace(setting, defense_config=PRUNE)
    x, y = batch()
    top = [dsnr_of(dict(chains=4, rows=2, boost=1000), s, x, y, model, setting, threat)[0] for s in range(3)]
    middle = [dsnr_of(dict(chains=1, rows=4, boost=1000, cuts="middle"), s, x, y, model, setting, threat)[0] for s in range(3)]
    assert max(top) > 2 and max(middle) < 0.5


def test_the_middle_trap_passes_every_check_d_snr_included_and_reads_samples_through_gradprune():
    """On 64 LFW faces, its rows disguised (``disguise: auto``: a part the faces barely see) against the
    near-parallel-rows check. (On uniform noise images nothing is unseen: the disguise moves every row's
    measurement, and the isolation check refuses it.)"""
    from guardfl.redteam.modality.image.models import FC2

    x, y, model, setting, threat, _ = lfw_client(FC2, FedSGD(), PRUNE)
    client = ClientQuery(x, y, PRUNE, FedSGD(), inspect=True, reference=model, disaggregation=True)
    rec = get("trap_weights", seed=0, chains=1, rows=4, boost=1000, cuts="middle").interrogate(client, setting, threat)
    assert "refused" not in rec.info and rec.info["cuts"] == "middle" and exact(rec, x) >= 1
    assert rec.info["disguised"].startswith("4 rows, rho 0.14")
    sent = rec.info["malicious_model"].state_dict()["net.1.weight"]
    assert int((sent == model.state_dict()["net.1.weight"]).all(dim=1).sum()) == 256 - 4  # the rest honest


def test_rows_auto_fits_the_median_trap_in_what_gradprune_099_keeps_and_reads_a_face_past_d_snr():
    """GradPrune 0.99 keeps 2 whole rows of FC-2's first layer (1,600 of 160,000 weights). The fixed 6-row
    median trap is cut to 2 rows and a part of a third and reads nothing exactly; ``rows: auto`` sends 2
    rows, both survive whole, and their one bin gives a face back exactly, past every check, D-SNR included
    (5 of 8 trap seeds on these 64 faces; seed 0 is one of them)."""
    from guardfl.redteam.modality.image.models import FC2

    strict = {"kind": "gradprune", "ratio": 0.99}
    x, y, model, setting, threat, _ = lfw_client(FC2, FedSGD(), strict)
    client = ClientQuery(x, y, strict, FedSGD(), inspect=True, reference=model, disaggregation=True)
    fixed = get("trap_weights", seed=0, chains=1, rows=6, boost=1000, cuts="middle").interrogate(client, setting, threat)
    auto = get("trap_weights", seed=0, chains=1, rows="auto", boost=1000, cuts="middle").interrogate(client, setting, threat)
    assert "refused" not in auto.info and auto.info["rows"].startswith("2 (auto: the pruning keeps 2 whole row(s)")
    assert exact(fixed, x) == 0 and exact(auto, x) >= 1
    sent = auto.info["malicious_model"].state_dict()["net.1.weight"]
    trapped = torch.nonzero(~(sent == model.state_dict()["net.1.weight"]).all(dim=1)).flatten()
    update = ClientQuery(x, y, strict, FedSGD())(auto.info["malicious_model"]).update["net.1.weight"]
    assert trapped.numel() == 2 and bool((update[trapped] != 0).float().mean(1).gt(0.99).all())  # whole rows sent


def test_the_middle_trap_reads_no_candidate_from_its_top_row():
    """Its top row holds every sample above the highest cut (half the batch, less the bins): no bin."""
    from guardfl.redteam.attacks.malicious.trap_weights import recover

    w = torch.tensor([[3.0, 3.0], [2.0, 2.0], [1.0, 1.0]])  # rows in cut-off order: sums over nested sets
    b = torch.tensor([3.0, 2.0, 1.0])
    _, with_top = recover(w, b, [torch.arange(3)], 3, (2,), (0.0, 1.0), 1e-6)
    _, without = recover(w, b, [torch.arange(3)], 3, (2,), (0.0, 1.0), 1e-6, top_row=False)
    assert (with_top, without) == (3, 2)


def test_cuts_need_rows_and_name_the_field():
    with pytest.raises(ValueError, match=r"cuts: 'middle' places a small trap's rows, but rows is null"):
        get("trap_weights", cuts="middle")
    with pytest.raises(ValueError, match="cuts"):
        get("trap_weights", rows=4, cuts="bottom")


def test_a_client_query_with_dsnr_needs_inspection():
    x, y = batch(4)
    with pytest.raises(Exception, match="^client.inspect_disaggregation: true adds a check"):
        ClientQuery(x, y, None, FedSGD(), disaggregation=True)


# -- through BatchNorm (Linear -> BatchNorm1d -> ReLU -> Linear): the cut-offs in its affine parameters --------
def setup_bn(n=32):
    from guardfl.redteam.modality.image.models import FC2BN

    model, setting, threat = setup(n)
    torch.manual_seed(0)
    bn = FC2BN()
    return bn, replace(setting, model=bn), threat


def test_applicable_through_an_affine_batchnorm_only():
    from guardfl.redteam.attacks.malicious.trap_weights import trap_layers

    bn, setting, threat = setup_bn()
    assert get("trap_weights").applicable(setting, threat) is None
    assert trap_layers(bn, SHAPE).norm_name == "net.2"
    plain = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3072, 64), torch.nn.BatchNorm1d(64, affine=False),
                                torch.nn.ReLU(), torch.nn.Linear(64, 10))
    assert "affine nn.BatchNorm1d" in get("trap_weights").applicable(replace(setting, model=plain), threat)


def test_through_batchnorm_the_bins_are_the_samples_up_to_two_batch_terms():
    """trap_norm.bins with the batch's own mean, T and variance gives each single-sample bin's image
    exactly: the maths of BatchNorm's backward pass, undone (the attack estimates those terms on aux)."""
    from guardfl.redteam.attacks.malicious import trap_norm
    from guardfl.redteam.attacks.malicious.trap_weights import craft, trap_layers

    bn, _, threat = setup_bn()
    x, y = batch(16)
    trap = craft(bn, trap_layers(bn, SHAPE), SHAPE, threat.aux.images, 1, 0.0, (0.0, 1.0), torch.Generator().manual_seed(0),
                 None, 16)
    trap.sent.train()
    loss = torch.nn.functional.cross_entropy(trap.sent(x), y)
    names = [k for k, _ in trap.sent.named_parameters()]
    grads = dict(zip(names, torch.autograd.grad(loss, list(trap.sent.parameters()))))
    (rows,), ((m, alpha, gamma),) = trap.chains, trap.norm_chains
    flat = x.flatten(1).double()
    s = flat @ m
    t = (s - s.mean()) / s.std(unbiased=False)
    images, mass = trap_norm.bins(grads["net.1.weight"][rows], grads["net.2.weight"][rows], grads["net.2.bias"][rows],
                                  alpha, gamma, 1e-5, flat.mean(0), (t[:, None] * flat).mean(0), float(s.var(unbiased=False)))
    cuts = -trap.sent.net[2].bias.detach().double()[rows] / gamma
    fires = t[:, None] > cuts[None, :]  # batch x rows
    alone = [i for i in range(len(rows)) if int(fires[:, i].sum()) - int(fires[:, i + 1].sum() if i + 1 < len(rows) else 0) == 1]
    assert len(alone) >= 6
    for i in alone:
        n = int((fires[:, i] & ~(fires[:, i + 1] if i + 1 < len(rows) else torch.zeros_like(fires[:, i]))).nonzero())
        assert float((images[i] - flat[n]).abs().max()) < 1e-2 and float((images[i] - flat[n]).abs().mean()) < 2e-3, i


def test_the_trap_through_batchnorm_passes_the_linear_layer_checks_and_the_normalised_output_check_refuses_it():
    """Behind BatchNorm every row's gradient mixes the whole batch: the isolation at the linear layer sees
    nothing, D-SNR neither; the bins are in the gradient at BatchNorm's output, which inspect_model examines."""
    bn, setting, threat = setup_bn()
    x, y = batch()
    rec = get("trap_weights", seed=0).interrogate(ClientQuery(x, y, None, FedSGD()), setting, threat)
    assert exact(rec, x) >= 8 and rec.info["through"].startswith("BatchNorm1d 'net.2'")
    found = inspect_model(rec.info["malicious_model"], bn, batch=(x, y), disaggregation=True)
    layers = found.checks["isolation"]["layers"]
    assert layers["net.1"]["isolated"] == 0 and found.checks["disaggregation"]["max"] < 2
    assert layers["net.1 -> net.2"]["isolated"] >= 16 and not found.ok
    batch_reasons = [r for r in found.reasons  # a chain's rows, and its one classifier column
                     if not r.startswith(("parallel rows: layer 'net.1'", "shared columns: layer 'net.4'"))]
    assert batch_reasons and all(r.startswith("isolation: layer 'net.1 -> net.2'") for r in batch_reasons)
    client = ClientQuery(x, y, None, FedSGD(), inspect=True, reference=bn)
    disguised = get("trap_weights", seed=0, disguise=0.15, column_noise=0)
    assert "isolation: layer 'net.1 -> net.2'" in disguised.interrogate(client, setting, threat).info["refused"]


def test_a_small_trap_through_batchnorm_passes_the_inspection_and_reads_a_sample():
    """The construction adapted to the check at BatchNorm's output: three rows at the top (on this batch the
    honest model already isolates 13 of 32 there; seeds 0 and 3 of this trap are refused, 1 and 2 pass)."""
    bn, setting, threat = setup_bn()
    x, y = batch()
    client = ClientQuery(x, y, None, FedSGD(), inspect=True, reference=bn)
    rec = get("trap_weights", seed=1, chains=1, rows=3).interrogate(client, setting, threat)
    assert "refused" not in rec.info and max(r["ssim"] for r in metrics.evaluate(rec, x)["per_image"]) > 0.8


def test_boost_auto_follows_the_known_defense():
    from guardfl.redteam.attacks.malicious.trap_weights import TRAP_BOOST, boost_for

    assert boost_for({"kind": "gaussian", "sigma": 0.01}) == boost_for({"kind": "outpost"}) == TRAP_BOOST
    assert boost_for({"kind": "gradprune", "ratio": 0.9}) == TRAP_BOOST
    assert boost_for({"kind": "sign"}) == boost_for(None) == 1.0
    assert boost_for({"kind": "dpsgd", "noise_multiplier": 1.0, "max_grad_norm": 1.0}) == 1.0
    assert boost_for({"kind": "stack", "defenses": [{"kind": "sign"}, {"kind": "laplace", "scale": 0.1}]}) == TRAP_BOOST
    model, setting, threat = setup()
    x, y = batch()
    noise = {"kind": "gaussian", "sigma": 0.01}
    noisy = replace(setting, defense_config=noise)
    known = get("trap_weights", seed=0, chains=1, rows=4).interrogate(ClientQuery(x, y, noise, FedSGD()), noisy, threat)
    blind = get("trap_weights", seed=0, chains=1, rows=4).interrogate(ClientQuery(x, y, noise, FedSGD()), noisy,
                                                                       threat.model_copy(update={"defense": "unknown"}))
    assert (known.info["boost"], blind.info["boost"]) == (TRAP_BOOST, 1.0)
    assert exact(known, x) >= 1 and exact(blind, x) == 0
    with pytest.raises(ValueError, match="expected 'auto' or a number"):
        get("trap_weights", boost=0.5)


# -- through GroupNorm (BatchNorm swapped by guardfl.dp_compatible, as Opacus needs) -------------------------------
def setup_gn(n=32):
    import guardfl

    bn, setting, threat = setup_bn(n)
    gn = guardfl.dp_compatible(bn)
    assert isinstance(gn.net[2], torch.nn.GroupNorm)
    return gn, replace(setting, model=gn), threat


def test_through_groupnorm_every_sample_alone_in_its_group_comes_back_exactly():
    """One measuring channel per group, the group's other channels constants spread far apart: GroupNorm
    normalises per sample, so the bins are exact (a batch of 16 in 32 groups)."""
    gn, setting, threat = setup_gn(16)
    x, y = batch(16)
    rec = get("trap_weights", seed=0, chains=1).interrogate(ClientQuery(x, y, None, FedSGD()), replace(setting, num_samples=16), threat)
    assert rec.info["through"].startswith("GroupNorm 'net.2'") and rec.info["bins"] == 32
    assert exact(rec, x) >= 10
    found = inspect_model(rec.info["malicious_model"], gn, batch=(x, y))
    assert not found.ok and any(r.startswith("isolation:") for r in found.reasons)


def test_a_small_trap_through_groupnorm_passes_the_inspection_and_reads_a_sample():
    gn, setting, threat = setup_gn()
    x, y = batch()
    client = ClientQuery(x, y, None, FedSGD(), inspect=True, reference=gn)
    recs = [get("trap_weights", seed=s, chains=1, rows=3).interrogate(client, setting, threat) for s in range(3)]
    passed = [r for r in recs if "refused" not in r.info]
    assert passed and max(exact(r, x) for r in passed) >= 1


def test_groups_of_two_are_not_applicable():
    _, setting, threat = setup()
    two = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3072, 64), torch.nn.GroupNorm(32, 64), torch.nn.ReLU(),
                              torch.nn.Linear(64, 10))
    assert "groups of 3 or more" in get("trap_weights").applicable(replace(setting, model=two), threat)


# -- through LayerNorm (per sample, over all of the layer's units) ---------------------------------------------
def setup_ln(n=32):
    from guardfl.redteam.modality.image.models import FC2LN

    model, setting, threat = setup(n)
    torch.manual_seed(0)
    ln = FC2LN()
    return ln, replace(setting, model=ln), threat


def single_bins(trap, x, y):
    """(bin image, the one sample in it) for every bin of the trap that holds one sample, from the crafted
    model's own gradient on (x, y): the ground truth the attack never sees."""
    from guardfl.redteam.attacks.malicious.robbing_the_fed import bin_differences

    net = trap.sent.train()
    fired = {}
    hook = net.net[3].register_forward_hook(lambda m, i, o: fired.__setitem__("h", o.detach() > 0))
    loss = torch.nn.functional.cross_entropy(net(x), y)
    hook.remove()
    g = dict(zip([k for k, _ in net.named_parameters()], torch.autograd.grad(loss, list(net.parameters()))))
    pairs = []
    for rows in trap.chains:
        fires = fired["h"][:, rows]
        above = torch.cat([fires[:, 1:], torch.zeros_like(fires[:, :1])], 1)
        assert not bool((above & ~fires).any()), "the rows of a chain are nested"
        dw, db = bin_differences(g["net.1.weight"][rows].double(), g["net.1.bias"][rows].double())
        for i in range(len(rows)):
            members = (fires[:, i] & ~above[:, i]).nonzero().flatten()
            if len(members) == 1:
                pairs.append((dw[i] / db[i], int(members[0])))
    return pairs


@pytest.mark.parametrize("with_aux", [True, False])
def test_through_layernorm_every_sample_alone_in_its_bin_comes_back_exactly(with_aux):
    """Spread constants fix every sample's standard deviation, a chain's rows normalise one measurement and
    share one LayerNorm weight: LayerNorm's coupling of a sample's units cancels in adjacent differences."""
    from guardfl.redteam.attacks.malicious.trap_weights import craft, trap_layers

    ln, _, threat = setup_ln()
    x, y = batch()
    aux = threat.aux.images if with_aux else None
    trap = craft(ln, trap_layers(ln, SHAPE), SHAPE, aux, 2, 0.0, (0.0, 1.0), torch.Generator().manual_seed(0), None, 32)
    errors = sorted(float((image - x[n].flatten().double()).abs().max()) for image, n in single_bins(trap, x, y))
    assert len(errors) >= 16
    assert errors[len(errors) // 2] < 1e-5 and errors[-1] < 1e-2  # the worst: float32 cancellation in a low bin


def test_through_layernorm_the_whole_layer_is_refused_and_a_small_trap_passes_and_reads():
    """A batch of 64: on 32 uniform images the honest model at its default init already isolates all 32 at
    LayerNorm's output (20 of 64), so no count could be judged above it."""
    ln, setting, threat = setup_ln(64)
    x, y = batch(64)
    rec = get("trap_weights", seed=0).interrogate(ClientQuery(x, y, None, FedSGD()), setting, threat)
    assert rec.info["through"].startswith("LayerNorm 'net.2'") and exact(rec, x) >= 10
    found = inspect_model(rec.info["malicious_model"], ln, batch=(x, y), disaggregation=True)
    assert found.checks["isolation"]["layers"]["net.1"]["isolated"] == 0 and found.checks["disaggregation"]["max"] < 2
    batch_reasons = [r for r in found.reasons  # a chain's rows, and its one classifier column
                     if not r.startswith(("parallel rows: layer 'net.1'", "shared columns: layer 'net.4'"))]
    assert not found.ok and batch_reasons and all(r.startswith("isolation: layer 'net.1 -> net.2'") for r in batch_reasons)
    client = ClientQuery(x, y, None, FedSGD(), inspect=True, reference=ln)
    recs = [get("trap_weights", seed=s, chains=1, rows=3).interrogate(client, setting, threat) for s in range(3)]
    passed = [r for r in recs if "refused" not in r.info]
    assert passed and max(exact(r, x) for r in passed) >= 1


def test_a_layernorm_without_bias_or_over_other_units_is_not_applicable():
    _, setting, threat = setup()
    for norm in (torch.nn.LayerNorm(64, bias=False), torch.nn.LayerNorm(64, elementwise_affine=False)):
        model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3072, 64), norm, torch.nn.ReLU(), torch.nn.Linear(64, 10))
        assert "nn.LayerNorm over 8 or more" in get("trap_weights").applicable(replace(setting, model=model), threat)


# -- on 64 LFW faces (the attacker's aux: the other faces) -------------------------------------------------------
def lfw_client(model_cls, protocol, defense=None):
    """(x, y, model, setting, threat, query): a client of ``model_cls`` holding 64 LFW faces."""
    from guardfl.redteam.modality.image.data import lfw_faces

    faces, labels = lfw_faces(10)
    x, y = faces[:64], labels[:64]
    shape = tuple(x.shape[1:])
    torch.manual_seed(0)
    model = model_cls(shape, 10)
    setting = Setting(model, protocol, 64, shape, 10, (0.0, 1.0), defense)
    threat = ThreatModel(server="malicious", labels="known", aux=AuxData(faces[64:], labels[64:]))
    return x, y, model, setting, threat, ClientQuery(x, y, defense, protocol)


# -- against FedAvg: one scale per chain ------------------------------------------------------------------------
def test_against_fedavg_one_scale_per_chain_keeps_the_bins_over_local_steps():
    """Over 4 local steps the classifier columns of rows with random scales drift apart and the adjacent
    differences stop cancelling; rows that share one scale drift apart by at most a bin's width.
    ``scales: auto`` picks that against a FedAvg client and keeps random scales under FedSGD. 64 LFW faces
    (on uniform noise images the random scales lose less: 14-22 of 64 against 20-27)."""
    from guardfl.redteam.client.simulate import FedAvg
    from guardfl.redteam.modality.image.models import FC2

    x, y, model, local, threat, query = lfw_client(FC2, FedAvg(epochs=1, batch_size=16, lr=0.1))
    auto = get("trap_weights", seed=0).interrogate(query, local, threat)
    random_scales = get("trap_weights", seed=0, scales="random").interrogate(query, local, threat)
    assert auto.info["scales"] == "equal" and random_scales.info["scales"] == "random"
    assert exact(auto, x) >= 15 and exact(random_scales, x) <= 8
    fedsgd = get("trap_weights", seed=0).interrogate(ClientQuery(x, y, None, FedSGD()), replace(local, protocol=FedSGD()), threat)
    assert fedsgd.info["scales"] == "random"
    found = inspect_model(auto.info["malicious_model"], model)  # the weight checks: no row repeats exactly
    assert found.checks["imprint"]["max_duplicate_row_share"] == 0
    assert [r.split(":")[0] for r in found.reasons] == ["parallel rows"]  # one direction per chain
    with pytest.raises(ValueError, match="scales"):
        get("trap_weights", scales="same")


def test_against_fedavg_the_groupnorm_trap_undoes_the_normalisation_and_its_update_keeps_its_digits():
    """Through GroupNorm each measuring row's update was ~1e-4 of its weights (the slope over the group's
    spread): a FedAvg delta, a difference of float32 weights, kept three digits of it, and the bins' differences
    none (0 faces exact after one step of 64). ``scales: auto`` against FedAvg sets each measuring channel's
    GroupNorm weight to the chain's scale over its slope."""
    from guardfl.redteam.client.simulate import FedAvg
    from guardfl.redteam.modality.image.models import FC2GN

    x, y, model, local, threat, query = lfw_client(FC2GN, FedAvg(epochs=1, batch_size=16, lr=0.1))
    auto = get("trap_weights", seed=0).interrogate(query, local, threat)
    random_scales = get("trap_weights", seed=0, scales="random").interrogate(query, local, threat)
    assert exact(auto, x) >= 5 and exact(random_scales, x) <= 2
    assert inspect_model(auto.info["malicious_model"], model).checks["imprint"]["max_duplicate_row_share"] == 0


# -- against Outpost: the constants of the per-sample normalisations in the weights -----------------------------
def test_against_a_known_outpost_the_layernorm_trap_puts_its_constants_in_the_weights_and_reads_through_it():
    """Outpost's noise on a layer is lambda times the variance of its current values: constants of 1e4 in the
    first layer's biases make the noise on the bias update ~1e8 and drown the bins (a client behind
    LayerNorm and Outpost was CERTIFIED by that). Knowing the defense, the trap writes them into the weights
    (``c <carrier, x>``), where they add little variance, and reads through Outpost. Outpost's noise comes
    from OS entropy: 4 chains of 2 rows read 1 face in 288 of 300 runs and none in 12 (a CI run failed on
    it); 4 chains of 4 rows read 2 faces in 300 of 300 (blind: 0 in 60)."""
    from guardfl.redteam.modality.image.models import FC2LN

    x, y, _, setting, threat, query = lfw_client(FC2LN, FedSGD(), {"kind": "outpost"})
    budget = {"chains": 4, "rows": 4, "boost": 1000}
    adapted = get("trap_weights", seed=0, **budget).interrogate(query, setting, threat)
    blind = get("trap_weights", seed=0, **budget).interrogate(query, setting, threat.model_copy(update={"defense": "unknown"}))
    assert adapted.info["constants"].startswith("in the weights") and "constants" not in blind.info
    sent = adapted.info["malicious_model"].net[1]
    assert float(sent.bias.detach().var()) < 1.0 < float(blind.info["malicious_model"].net[1].bias.detach().var())
    assert exact(adapted, x) >= 1 and exact(blind, x) == 0


# -- against the near-parallel-rows check: disguise, single rows ---------------------------------------------------
def test_disguise_auto_is_on_for_small_traps_and_its_bad_values_are_one_line():
    from guardfl.redteam.attacks.malicious.trap_chain import auto_rho

    assert get("trap_weights").config.disguise == "auto" and 0.1 < auto_rho() < 0.2
    for bad in (-0.1, 5, "big", True):
        with pytest.raises(ValueError, match=r"expected 'auto' or a number in \[0, 4\]"):
            get("trap_weights", disguise=bad)


def test_single_rows_pass_the_inspection_and_read_faces_without_any_disguise():
    """``rows: 1``: each row its own measurement cut at the top; no two rows alike, so nothing is disguised,
    and a row that holds one face gives it back exactly (64 LFW faces, FC-2)."""
    from guardfl.redteam.modality.image.models import FC2

    x, y, model, setting, threat, _ = lfw_client(FC2, FedSGD())
    client = ClientQuery(x, y, None, FedSGD(), inspect=True, reference=model)
    rec = get("trap_weights", seed=0, chains=8, rows=1).interrogate(client, setting, threat)
    assert "refused" not in rec.info and rec.info["disguised"] == "none" and exact(rec, x) >= 1
    sent = rec.info["malicious_model"].state_dict()["net.1.weight"]
    assert int((sent == model.state_dict()["net.1.weight"]).all(dim=1).sum()) == 256 - 8


# -- against the shared-columns check: column_noise auto ------------------------------------------------------------
def test_an_inspecting_client_refuses_a_chain_with_one_column_and_auto_noise_passes_and_reads_faces():
    """A chain's rows share one classifier column, so every row gets one coefficient per sample: the
    shared-columns check refuses it on the client's batch. ``column_noise: auto`` tries noise levels on the
    attacker's own auxiliary faces with guardfl's check, sends the first that passes with margin, and the
    trap still reads faces exactly (64 LFW faces, FC-2, 8 rows at the top)."""
    from guardfl.redteam.attacks.malicious.trap_weights import COLUMN_NOISE_LEVELS as NOISE_STEPS
    from guardfl.redteam.modality.image.models import FC2

    x, y, model, setting, threat, _ = lfw_client(FC2, FedSGD())
    client = ClientQuery(x, y, None, FedSGD(), inspect=True, reference=model)
    shared = get("trap_weights", seed=0, chains=1, rows=8, column_noise=0).interrogate(client, setting, threat)
    assert shared.info["refused"].startswith("shared columns: layer 'net.3' gives 8 of its 256 input units")
    auto = get("trap_weights", seed=0, chains=1, rows=8).interrogate(client, setting, threat)
    assert "refused" not in auto.info and exact(auto, x) >= 1
    noise = float(auto.info["column_noise"].split()[0])
    assert noise in NOISE_STEPS and "auxiliary samples" in auto.info["column_noise"]
    blind = get("trap_weights", seed=0, chains=1, rows=8).interrogate(ClientQuery(x, y, None, FedSGD()), setting, threat)
    single = get("trap_weights", seed=0, chains=8, rows=1).interrogate(client, setting, threat)
    assert blind.info["column_noise"].startswith("0 (auto: the client does not inspect")
    assert single.info["column_noise"].startswith("0 (auto: single rows share no column")


def test_column_noise_bad_values_are_one_line():
    for bad in (-0.1, 2, "some", True):
        with pytest.raises(ValueError, match=r"column_noise: expected 'auto' or a number in \[0, 1\]"):
            get("trap_weights", column_noise=bad)


def test_peeling_reads_the_samples_a_small_trap_and_the_honest_rows_hold_beyond_its_bins():
    """A small trap (one chain of 8 rows, the rest of the layer honest) on uncentred images: its bins read a
    few samples; the sent model's units that hold one sample alone, checked against that model and peeled
    (``peel``, the default), read many more, every checked one exactly a private image."""
    model, setting, threat = setup()
    x, y = batch()
    bins = get("trap_weights", seed=0, chains=1, rows=8, peel=False).interrogate(ClientQuery(x, y, None, FedSGD()), setting, threat)
    peeled = get("trap_weights", seed=0, chains=1, rows=8).interrogate(ClientQuery(x, y, None, FedSGD()), setting, threat)
    assert bins.info["checked"] == 0 and peeled.info["checked"] > 0
    k = peeled.info["checked"]
    nearest = (peeled.inputs[:k].flatten(1)[:, None] - x.flatten(1)[None]).abs().amax(2).min(1).values
    assert float(nearest.max()) < 1e-3
    assert exact(peeled, x) >= exact(bins, x) + 4


def test_peeling_does_not_read_through_a_pruned_update():
    """GradPrune's zeros break every check: nothing is claimed, the bins' reading stands."""
    model, setting, threat = setup()
    x, y = batch()
    setting = replace(setting, defense_config={"kind": "gradprune", "ratio": 0.9})
    client = ClientQuery(x, y, {"kind": "gradprune", "ratio": 0.9}, FedSGD())
    rec = get("trap_weights", seed=0, chains=4, rows=2, boost=1000).interrogate(client, setting, threat)
    assert rec.info["checked"] == 0
