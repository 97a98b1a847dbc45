"""client.inspect_leak_limit in a certificate: the simulated client refuses any model, the honest one too,
with which the server reads more than k samples of its batch, and the certificate says what that cost."""

import yaml

from guardfl.redteam.certification.run import certify
from guardfl.cli import main
from tests.claims import leaked

FC = {
    "model": {"name": "fc2", "num_classes": 10, "state": "default"},
    "data": {"source": "lfw-faces", "limit": 64},
    "client": {"protocol": "fedsgd", "batch_size": 64, "inspect": True, "inspect_leak_limit": 0},
    "defense": None,
    "aux": {"source": "lfw-faces", "offset": 64},
    "attacks": [{"name": "exclusive_neurons", "threat": {"labels": "known"}},
                {"name": "trap_weights", "budget": {"chains": 1, "rows": 8}, "threat": {"server": "malicious", "labels": "known"}}],
    "certify": {"max_ssim": 0.4, "max_leak_rate": 0.05, "max_updates": 1},
    "seed": 0,
}


def test_the_limit_refuses_the_honest_models_own_leak_and_the_certificate_says_the_client_learned_nothing(tmp_path):
    """FC-2 on 64 faces in [0, 1] gives a third of them away by its own first layer: under a limit of 0 the
    client refuses the honest model (the honest server's attack reads nothing) and the trap (it reads
    more), so nothing leaks, and the warning says the client sent and learned nothing."""
    result = certify(FC, out=tmp_path)
    assert leaked(result) == 0
    by = {r["attack"]: r for r in result.results}
    honest, trap = by["exclusive_neurons"], by["trap_weights"]
    assert honest["info"]["refused"].startswith("leak limit: a server reads ") and honest["recovered"]["above_max_ssim"] == 0
    assert "leak limit" in trap["info"]["refused"] and trap["recovered"]["above_max_ssim"] == 0
    warning = [w for w in result.warnings if "refused the honest global model on 1 of 1 batches" in w]
    assert warning and "client.inspect_leak_limit: 0" in warning[0]
    inspection = result.client["inspection"]
    assert inspection["leak_limit"] == 0 and "leak_limit" in inspection["checks"]
    assert "refused the honest global model" in (tmp_path / "report.html").read_text()
    # the green rests on a trap the limit was built to refuse: the construction that passes it did not run
    (unadapted,) = [w for w in result.warnings if "no malicious-server construction built to pass it" in w]
    assert unadapted.startswith("the client runs client.inspect_leak_limit and no") and "(threshold_bins)" in unadapted


def test_without_a_limit_the_honest_model_is_not_refused():
    """The same client inspecting without a limit: the honest model passes every check (it is the client's
    own architecture) and the honest server reads faces exactly from it."""
    cfg = {**FC, "client": {**FC["client"], "inspect_leak_limit": None}, "attacks": FC["attacks"][:1] + [
        {"name": "robbing_the_fed", "threat": {"server": "malicious", "labels": "known"}}]}
    result = certify(cfg)
    assert leaked(result) > 0
    honest = next(r for r in result.results if r["attack"] == "exclusive_neurons")
    assert "refused" not in honest["info"] and honest["recovered"]["exact"] >= 8
    assert not [w for w in result.warnings if "honest global model" in w]
    # an inspecting client met by the published imprint alone: none of the disguised constructions ran
    (unadapted,) = [w for w in result.warnings if "no malicious-server construction built to pass it" in w]
    assert unadapted.startswith("the client runs client.inspect and no") and "trap_weights / fishing / seer" in unadapted
    assert result.client["inspection"]["not_run"][1].startswith("leak_limit (an absolute limit")


def test_a_limit_without_inspection_or_out_of_range_is_one_line(tmp_path, capsys):
    for client, words in (({"inspect": False}, "inspect_leak_limit: a limit adds a check to the client's inspection"),
                          ({"inspect_leak_limit": -1}, "client.inspect_leak_limit")):
        path = tmp_path / "c.yaml"
        path.write_text(yaml.safe_dump({**FC, "client": {**FC["client"], **client}}))
        assert main(["redteam", "--config", str(path), "--out", str(tmp_path / "o"), "--quiet"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and words in err, err


def test_a_limit_per_update_does_not_hold_against_a_server_that_lifts_every_unit_to_fire_for_every_sample():
    """The leak limit of one update counts the samples a unit's support isolates. ``threshold_bins`` gives no
    unit such a support (every hidden unit fires for every sample) and bins the batch with the classifier
    over 65 queries: against a client that keeps no history (``inspect_leak_history: false``, a client built
    anew each round) every model passes the limit of 0, and faces come back exactly (docs section 17)."""
    cfg = {**FC, "client": {**FC["client"], "inspect_leak_history": False},
           "attacks": [{"name": "threshold_bins", "threat": {"server": "malicious", "labels": "known"}}]}
    result = certify(cfg)
    assert leaked(result) > 0
    (bins,) = result.results
    assert "refused" not in bins["info"] and bins["info"]["refused_queries"] == "0" and bins["info"]["queries"] == "65"
    assert bins["recovered"]["exact"] >= 5  # 14 of 64 faces exactly
    assert not [w for w in result.warnings if "built to pass it" in w]  # the construction adapted to both checks ran


def test_a_limit_with_the_clients_history_refuses_the_differences_that_isolate_but_partial_reads_remain():
    """The default client keeps its history (``LeakHistory``): a query whose update differenced with an
    earlier one reads a face is refused (41 of 65), the server skips to the next threshold, and its wider
    bins read no face exactly (best SSIM 0.87) but 32 of 64 past SSIM 0.4: still NOT CERTIFIED (docs
    section 18: the limit counts exact reads, the certificate partial ones too)."""
    cfg = {**FC, "attacks": [{"name": "threshold_bins", "threat": {"server": "malicious", "labels": "known"}}]}
    result = certify(cfg)
    assert leaked(result) > 0
    (bins,) = result.results
    assert int(bins["info"]["refused_queries"]) >= 10 and bins["info"]["queries"] == "65"
    assert bins["recovered"]["exact"] == 0 and bins["recovered"]["above_max_ssim"] >= 5
    assert "with history" in result.client["inspection"]["leak_limit_scope"]


def test_leak_history_false_without_a_limit_is_one_line(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({**FC, "client": {**FC["client"], "inspect_leak_limit": None, "inspect_leak_history": False}}))
    assert main(["redteam", "--config", str(path), "--out", str(tmp_path / "o"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "inspect_leak_history" in err, err


def test_leak_history_limits_as_deployed_are_one_line_when_bad_and_bound_the_simulated_client(tmp_path, capsys):
    """``client.inspect_leak_history: {max_rounds: n, max_batches: m}``: the deployed client's LeakHistory limits
    (the integrations' ``inspect_leak_history`` mapping); a batch answered ``max_rounds`` times is refused."""
    import torch

    from guardfl.redteam.client.simulate import ClientQuery, FedSGD, ModelRefused
    from guardfl.redteam.config import RedTeamConfig
    from guardfl.redteam.modality.image.models import FC2

    for bad in ({"max_rounds": 0}, {"rounds": 3}, "some"):
        path = tmp_path / "c.yaml"
        path.write_text(yaml.safe_dump({**FC, "client": {**FC["client"], "inspect_leak_history": bad}}))
        assert main(["redteam", "--config", str(path), "--out", str(tmp_path / "o"), "--quiet"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "inspect_leak_history" in err, err
    cfg = RedTeamConfig.model_validate({**FC, "client": {**FC["client"], "inspect_leak_history": {"max_rounds": 1}}})
    assert cfg.client.leak_history_spec() == {"max_rounds": 1, "max_batches": 64}
    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(8, 3, 32, 32, generator=g), torch.arange(8)
    torch.manual_seed(0)
    model = FC2()
    client = ClientQuery(x, y, None, FedSGD(), inspect=True, reference=model, leak_limit=8, leak_history=cfg.client.leak_history_spec())
    client(model)
    try:
        client(model)
        raise AssertionError("the second round on the batch was accepted")
    except ModelRefused as refused:
        assert any("answered 1 times" in r for r in refused.reasons), refused.reasons
