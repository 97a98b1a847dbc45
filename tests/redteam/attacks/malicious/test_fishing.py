"""Fishing (class fishing): the crafted classifier isolates one class's gradient, which the attack then
inverts; it needs the labels, a classifier layer and FedSGD."""

import pytest
import torch

from guardfl.redteam import ThreatModel, simulate_client
from guardfl.redteam.attacks import Fishing, NotApplicable, Setting, get
from guardfl.redteam.attacks.malicious.fishing import classifier, fishing_model, isolated_view
from guardfl.redteam.client.simulate import ClientQuery, FedAvg, FedSGD
from guardfl.redteam.modality.image.models import LeNetZhu

LABELS = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3])  # classes 4-7 once each


def cosine(a, b):
    return float((a * b).sum() / (a.norm() * b.norm()))


def test_the_fished_update_is_the_target_samples_gradient_alone(faces):
    torch.manual_seed(0)
    model = LeNetZhu((1, 25, 25), 10)
    x = faces[:12]
    sent = fishing_model(model, 10, target=5, beta=50.0)
    name, layer = classifier(sent, 10)
    assert int((layer.weight.detach().abs().sum(1) > 0).sum()) == 1 and float(layer.bias.detach()[5]) == -50.0
    batch = simulate_client(sent, x, LABELS)
    alone = simulate_client(sent, x[5:6], LABELS[5:6])
    view = isolated_view(batch, name, target=5, count=1)
    for key, mask in view.matched.items():
        got, want = view.update[key][mask], alone.update[key][mask]
        if want.abs().sum() > 0:
            assert cosine(got, want) > 0.999, key  # the batch's gradient there is the sample's, scaled by 1/B
    assert view.num_samples == 1 and view.side.labels.tolist() == [5]


def test_the_attack_reconstructs_the_fished_face_better_than_the_rest(faces):
    from skimage.metrics import structural_similarity

    torch.manual_seed(0)
    from guardfl.redteam.modality.image.models import wide_init_

    model = wide_init_(LeNetZhu((1, 25, 25), 10))
    x = faces[:12]
    setting = Setting.of(simulate_client(model, x, LABELS))
    client = ClientQuery(x, LABELS, None, FedSGD())
    rec = get("fishing", seed=0, iterations=300, restarts=2).interrogate(
        client, setting, ThreatModel(server="malicious", labels="known"))
    assert rec.info["target_class"] == 4 and rec.info["queries"] == 2 and rec.info["client_mode"] == "train"
    target = structural_similarity(rec.inputs[0, 0].numpy(), x[4, 0].numpy(), data_range=1.0)
    others = [structural_similarity(rec.inputs[0, 0].numpy(), x[i, 0].numpy(), data_range=1.0) for i in range(12) if i != 4]
    assert target > max(others) and target > 0.3


def test_it_needs_labels_a_classifier_fedsgd_and_a_malicious_server(faces):
    model = LeNetZhu((1, 25, 25), 10)
    setting = Setting.of(simulate_client(model, faces[:2], torch.tensor([0, 1])))
    assert "threat.server: malicious" in Fishing.applicable(setting, ThreatModel(labels="known"))
    assert "threat.labels: known" in Fishing.applicable(setting, ThreatModel(server="malicious"))
    assert Fishing.applicable(setting, ThreatModel(server="malicious", labels="known")) is None
    avg = Setting.of(simulate_client(model, faces[:2], torch.tensor([0, 1]), protocol=FedAvg()))
    assert "fedsgd" in Fishing.applicable(avg, ThreatModel(server="malicious", labels="known"))
    conv_head = torch.nn.Sequential(torch.nn.Conv2d(1, 10, 25), torch.nn.Flatten())
    none = Setting.of(simulate_client(conv_head, faces[:2], torch.tensor([0, 1])))
    assert "final nn.Linear" in Fishing.applicable(none, ThreatModel(server="malicious", labels="known"))


def test_a_target_class_without_a_sample_is_one_line(faces):
    model = LeNetZhu((1, 25, 25), 10)
    setting = Setting.of(simulate_client(model, faces[:2], torch.tensor([0, 1])))
    client = ClientQuery(faces[:2], torch.tensor([0, 1]), None, FedSGD())
    with pytest.raises(ValueError, match="fishing.target_class: class 7 has no sample"):
        get("fishing", target_class=7, iterations=1).interrogate(client, setting, ThreatModel(server="malicious", labels="known"))
    with pytest.raises(NotApplicable, match="use interrogate"):
        get("fishing").reconstruct(simulate_client(model, faces[:2], torch.tensor([0, 1])),
                                   ThreatModel(server="malicious", labels="known"))


def test_feature_fishing_isolates_the_sample_with_the_largest_feature(faces):
    from guardfl.redteam.attacks.malicious.fishing import band_view, feature_fishing_model

    from guardfl.redteam.modality.image.models import wide_init_

    torch.manual_seed(0)
    model = wide_init_(LeNetZhu((1, 25, 25), 10))  # features that differ (a fresh LeNet's agree to 1e-6)
    x = faces[:12]
    name, layer = classifier(model, 10)
    with torch.no_grad():
        feats = torch.nn.Sequential(*list(model.children())[:-1])(x).flatten(1)[:, 7]
    order = feats.argsort(descending=True)
    top, second = float(feats[order[0]]), float(feats[order[1]])
    t1, t2 = (top + second) / 2, top + 1.0  # exactly the top sample between the thresholds
    upper = simulate_client(feature_fishing_model(model, 10, 3, 7, 1e6, t1), x, LABELS)
    lower = simulate_client(feature_fishing_model(model, 10, 3, 7, 1e6, t2), x, LABELS)
    # the server's count above t1: B x (target bias gradient) + the class's samples (2 of class 3)
    assert abs(12 * float(upper.update[f"{name}.bias"][3]) + 2 - 1) < 1e-3
    view = band_view(upper, lower, name, 3, 10)
    # the difference is the top sample's target-logit gradient
    sent = feature_fishing_model(model, 10, 3, 7, 1e6, t1)
    sent.zero_grad()
    sent(x[order[0]][None])[0, 3].backward()
    for key, p in sent.named_parameters():
        mask = view.matched[key]
        want = p.grad[mask]
        if want.abs().sum() > 0:
            assert cosine(view.update[key][mask], want) > 0.999, key
    assert view.side.labels.sum() == 0 and view.side.labels[0, 3] == -1


def test_feature_fishing_end_to_end_and_its_query_budget(faces):
    from skimage.metrics import structural_similarity

    torch.manual_seed(0)
    from guardfl.redteam.modality.image.models import wide_init_

    model = wide_init_(LeNetZhu((1, 25, 25), 10))
    x, y = faces[:16], torch.arange(16) % 10
    setting = Setting.of(simulate_client(model, x, y))
    threat = ThreatModel(server="malicious", labels="known")
    rec = get("fishing", seed=0, iterations=300, restarts=2, strategy="feature").interrogate(
        ClientQuery(x, y, None, FedSGD()), setting, threat)
    assert rec.info["strategy"] == "feature fishing" and 3 <= rec.info["queries"] <= 49
    best = max(structural_similarity(rec.inputs[0, 0].numpy(), x[i, 0].numpy(), data_range=1.0) for i in range(16))
    assert best > 0.4
    # out of queries: the attack fishes the class instead, and says why
    rec = get("fishing", seed=0, iterations=1, strategy="feature", max_queries=4).interrogate(
        ClientQuery(x, y, None, FedSGD()), setting, threat)
    assert "class fishing" in rec.info["strategy"] and "max_queries=4" in rec.info["feature_fishing"]


def test_disguised_fishing_adapts_its_other_rows_to_the_shared_columns_check(faces):
    """At ``DISGUISE_SCALE`` (3e-3) every feature's gradient runs through the target class alone, so every unit's
    coefficient per sample is parallel to every other's: the shared-columns check refuses it on the client's
    batch. Against an inspecting client the disguise takes the least scale that passes the check on the
    server's own batch (no auxiliary data here: uniform noise with the classes in turn), and is sent."""
    from guardfl.inspect import inspect_model
    from guardfl.redteam.attacks.malicious.fishing import DISGUISE_SCALE, DISGUISE_SCALES

    torch.manual_seed(0)
    model = LeNetZhu((1, 25, 25), 10)
    x, y = faces[:32], torch.arange(32) % 10
    found = inspect_model(fishing_model(model, 10, 5, 0.0, disguise=True, scale=DISGUISE_SCALE), model, batch=(x, y))
    assert [r.split(":")[0] for r in found.reasons] == ["shared columns"]
    setting = Setting(model, FedSGD(), 32, (1, 25, 25), 10, (0.0, 1.0), None)
    client = ClientQuery(x, y, None, FedSGD(), inspect=True, reference=model)
    rec = get("fishing", seed=0, strategy="class", disguise=True, iterations=2, restarts=1).interrogate(
        client, setting, ThreatModel(server="malicious", labels="known"))
    assert "refused" not in rec.info and rec.info["other_rows_scale"].endswith("uniform noise inputs (no auxiliary data))")
    assert float(rec.info["other_rows_scale"].split()[0]) in DISGUISE_SCALES[1:]
