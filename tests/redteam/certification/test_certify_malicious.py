"""A malicious server in the certificate: ``threat.server: malicious`` runs the attacks that send the
client a model of their own making; an honest-server certificate lists them as not applicable."""

from pathlib import Path

import pytest
import yaml

from guardfl.cli import main
from guardfl.redteam.certification.run import certify
from tests.seeding import seeded
from tests.claims import leaked

CONFIGS = Path(__file__).resolve().parents[3] / "configs" / "research"


def _seeded(name: str, seed: int = 0) -> dict:
    """A shipped config with its defense seeded. A deployed defense draws from OS entropy, so a certificate
    near its limit is a draw (``malicious-adaptive-gn-dpsgd.yaml``: one CI run of about ten NOT CERTIFIED,
    docs/research/malicious-server.md section 24); a test of the pipeline takes one fixed draw."""
    cfg = yaml.safe_load((CONFIGS / name).read_text())
    cfg["defense"] = seeded(cfg["defense"], seed)
    return cfg


def test_robbing_the_fed_breaks_the_undefended_client_and_adapts_to_gradprune():
    plain = certify(str(CONFIGS / "malicious-rtf.yaml"))
    assert leaked(plain) > 0
    (record,) = plain.results
    assert record["attack"] == "robbing_the_fed" and record["threat"]["server"] == "malicious"
    assert record["recovered"]["exact"] >= 40 and record["info"]["queries"] == "1"
    assert record["info"]["malicious_model"] == "Imprinted"  # the crafted model, named in the record
    assert record["info"]["pad"] == "0" and record["info"]["boost"] == "1.0"  # nothing to adapt to
    # GradPrune 0.9 certified against the published construction; the server that knows it pads the
    # imprint layer with dead rows, and the per-layer pruning keeps every bin row (issue 34)
    pruned = certify(str(CONFIGS / "malicious-rtf-gradprune.yaml"))
    assert leaked(pruned) > 0 and pruned.results[0]["recovered"]["exact"] >= 40
    assert int(pruned.results[0]["info"]["pad"]) > 0


@pytest.mark.parametrize("defense, holds", [
    ({"kind": "gaussian", "sigma": 0.01}, False),   # boosted gradients drown fixed-scale noise
    ({"kind": "sign"}, True),                        # no magnitude left to boost
])
def test_the_adaptive_imprint_against_noise_and_sign(defense, holds):
    cfg = yaml.safe_load((CONFIGS / "malicious-rtf.yaml").read_text())
    cfg["defense"] = defense
    cert = certify(cfg)
    assert (leaked(cert) == 0) == holds
    assert float(cert.results[0]["info"]["boost"]) == (1.0 if holds else 1e5)


def test_fishing_breaks_the_undefended_client_in_train_mode():
    cfg = yaml.safe_load((CONFIGS / "malicious-fishing.yaml").read_text())
    cfg["attacks"][0]["budget"] = {"iterations": 300, "restarts": 2}
    cert = certify(cfg)
    assert leaked(cert) > 0 and cert.evidence["leaked_samples"]
    assert {r["info"]["queries"] for r in cert.results} == {"2"}
    assert all(r["info"]["client_mode"] == "train" for r in cert.results)


def test_attacks_all_is_the_honest_server_certificate_and_lists_it_as_not_applicable():
    import torch

    from guardfl.redteam import simulate_client
    from guardfl.redteam.attacks import Setting
    from guardfl.redteam.certification.plan import plan_attacks
    from guardfl.redteam.config import load_config
    from guardfl.redteam.modality.image.models import LeNetZhu

    cfg = load_config({"model": {"name": "lenet"}, "data": {"source": "lfw-faces"}, "client": {"batch_size": 1},
                       "certify": {"max_updates": 1}})
    setting = Setting.of(simulate_client(LeNetZhu((1, 25, 25), 10), torch.rand(1, 1, 25, 25), torch.tensor([0])))
    plans, listing = plan_attacks(cfg, setting, "quick", None)
    line = next(a for a in listing if a["attack"] == "robbing_the_fed")
    assert line["status"] == "not applicable" and "threat.server: malicious" in line["reason"]
    assert all(p.threat.server == "honest" for p in plans)


@pytest.mark.parametrize("threat,expect", [
    ({"server": "evil"}, "server"),
])
def test_bad_threat_server_is_one_line(tmp_path, capsys, threat, expect):
    cfg = yaml.safe_load((CONFIGS / "malicious-rtf.yaml").read_text())
    cfg["attacks"][0]["threat"] = threat
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["redteam", "--config", str(path), "--out", str(tmp_path / "o"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expect in err and "'honest' or 'malicious'" in err


def test_the_adaptive_server_meets_the_inspection_and_only_a_defense_certifies(tmp_path):
    """configs/research/malicious-adaptive*.yaml (issue 34): an inspecting client refuses the imprint block, class
    fishing and the whole-layer trap (nothing sent: no leak, the reasons on record; the trap's chains are
    near-parallel rows); the small trap built against the isolation
    check (its rows disguised against the near-parallel-rows check, its chain's column varied against the
    shared-columns check), the single-row trap, the boosted 2-row trap, 8 chains of 6 rows (within chance of
    the honest FC-2's own isolation on these uncentred faces) and the disguised fishing (its other rows
    scaled to pass the shared-columns check) pass it and leak without a defense; so does the trap sized on
    shadows of the client (``rows: fit``, the largest it reads most with), which says what it tried; DP-SGD
    holds. The trap whose cuts hold 4 rows with their own columns (``columns: 4``) passes too: on these faces
    in [0, 1] its count stays within chance of the honest FC-2's own. So do the threshold bins (every hidden
    unit lifted to fire for every sample, the batch binned by the classifier over 65 queries); DP-SGD's
    fresh noise per query holds against them."""
    inspecting = certify(str(CONFIGS / "malicious-adaptive-inspect.yaml"), out=tmp_path)
    assert leaked(inspecting) > 0
    page = (tmp_path / "report.html").read_text()  # the report says what the inspection refused, and why
    assert "3 of 11 malicious-server attack runs refused" in page and page.count("REFUSED by the client") == 3
    by = {(r["attack"], r["budget"].get("rows"), r["budget"].get("disguise", False)): r for r in inspecting.results
          if "columns" not in r["budget"]}
    grouped = next(r for r in inspecting.results if r["budget"].get("columns") == 4)  # 4 rows per cut, their own columns
    assert grouped["info"].get("refused") is None and grouped["recovered"]["exact"] >= 5  # 11 faces exactly (docs section 12)
    for key, reason in ((("robbing_the_fed", None, False), "architecture:"), (("trap_weights", None, False), "parallel rows:"),
                        (("fishing", None, False), "class fishing:")):
        assert by[key]["info"]["refused"].startswith(reason) and by[key]["recovered"]["above_max_ssim"] == 0
    for key in (("trap_weights", 8, False), ("trap_weights", 1, False), ("trap_weights", 2, False), ("trap_weights", 6, False),
                ("fishing", None, True)):
        assert by[key]["info"].get("refused") is None  # built to pass the inspection, and it does
    assert by[("trap_weights", 6, False)]["recovered"]["exact"] >= 5  # 12 of 64 faces exactly (docs section 10)
    # the fallback no inspection refuses: the honest model itself, read by its units exclusive to one face (docs section 14)
    honest = by[("exclusive_neurons", None, False)]
    assert honest["info"].get("refused") is None and honest["recovered"]["exact"] >= 10  # 27 faces exactly
    fitted = by[("trap_weights", "fit", False)]
    assert fitted["info"].get("refused") is None and fitted["recovered"]["exact"] >= 5  # 16 x 4: 11 faces exactly
    assert "fit on 64 auxiliary samples, 28 of them mirrored" in fitted["info"]["rows"] and "2 x all (refused 1)" in fitted["info"]["rows"]
    assert by[("trap_weights", 8, False)]["info"]["column_noise"].startswith("0.0")  # calibrated: 0.02-0.05
    assert by[("fishing", None, True)]["info"]["other_rows_scale"].endswith("auxiliary samples)")
    assert by[("trap_weights", 8, False)]["info"]["disguised"].startswith("8 rows")
    assert by[("trap_weights", 1, False)]["info"]["disguised"] == "none"  # one row per measurement: nothing to disguise
    assert max(by[key]["recovered"]["above_max_ssim"] for key in (("trap_weights", 8, False), ("fishing", None, True))) > 0
    bins = by[("threshold_bins", None, False)]  # every unit fires for every sample: no support isolates anyone (section 17)
    assert bins["info"].get("refused") is None and bins["recovered"]["exact"] >= 5  # 14 faces exactly
    defended = certify(_seeded("malicious-adaptive.yaml"))
    assert leaked(defended) == 0
    assert not defended.evidence["leaked_samples"]  # none past its limit (0.4, or the prior guess + 0.05)


def test_behind_batchnorm_the_inspection_refuses_the_large_traps_at_its_output_and_a_small_one_leaks():
    """configs/research/malicious-adaptive-bn.yaml: FC-2 with BatchNorm1d, the trap's cut-offs in BatchNorm's affine
    parameters. The whole-layer trap is refused (its chains repeat one direction). The 8-row trap, whose
    column noise against the shared-columns check took it under the pairwise isolation count at BatchNorm's
    output (docs/research/malicious-server.md section 9), is refused there again since the group test (section 12:
    4 of 64 isolated with combinations of two groups of units); the 3-row trap passes and leaks faces past
    SSIM 0.4: the config does not certify."""
    result = certify(str(CONFIGS / "malicious-adaptive-bn.yaml"))
    assert leaked(result) > 0
    by = {(r["attack"], r["budget"].get("rows"), r["budget"].get("cuts")): r for r in result.results}
    assert by[("trap_weights", None, None)]["info"]["refused"].startswith("parallel rows:")
    eight = by[("trap_weights", 8, None)]["info"]["refused"]
    assert eight.startswith("isolation: layer 'net.1 -> net.2'") and "combination of two groups" in eight
    small = by[("trap_weights", 3, None)]
    assert small["info"].get("refused") is None and small["recovered"]["above_max_ssim"] > 0


def test_the_groupnorm_mlp_that_inspects_and_runs_dp_sgd_certifies_against_the_traps_that_pass():
    """configs/research/malicious-adaptive-gn-dpsgd.yaml: the traps through GroupNorm that pass the inspection meet
    DP-SGD (0 of 64 past SSIM 0.4); the whole-layer trap is refused."""
    result = certify(_seeded("malicious-adaptive-gn-dpsgd.yaml"))
    assert leaked(result) == 0
    by = {(r["attack"], r["budget"].get("rows")): r for r in result.results}
    assert by[("trap_weights", None)]["info"]["refused"].startswith("parallel rows:")  # the measuring rows: one direction
    assert by[("trap_weights", 3)]["info"].get("refused") is None
    assert by[("trap_weights", 3)]["info"]["through"].startswith("GroupNorm 'net.2'")
    assert not result.evidence["leaked_samples"]  # none past its limit (0.4, or the prior guess + 0.05)


def test_behind_layernorm_the_small_traps_pass_and_read_faces_exactly_and_dp_sgd_holds():
    """configs/research/malicious-adaptive-ln*.yaml: FC-2 with LayerNorm, the traps through it exact (spread constants,
    one LayerNorm weight per chain). The whole-layer trap is refused (its chains' rows); the small traps
    pass and read a face exactly without a defense; DP-SGD holds against them."""
    result = certify(str(CONFIGS / "malicious-adaptive-ln.yaml"))
    assert leaked(result) > 0
    by = {(r["attack"], r["budget"].get("rows")): r for r in result.results}
    assert by[("trap_weights", None)]["info"]["refused"].startswith("parallel rows:")
    small = by[("trap_weights", 3)]
    assert small["info"].get("refused") is None and small["info"]["through"].startswith("LayerNorm 'net.2'")
    assert small["recovered"]["above_max_ssim"] > 0
    defended = certify(_seeded("malicious-adaptive-ln-dpsgd.yaml"))
    assert leaked(defended) == 0
    assert not defended.evidence["leaked_samples"]  # none past its limit (0.4, or the prior guess + 0.05)


def test_disguised_class_fishing_passes_the_classifier_checks_and_is_class_fishing_only():
    import torch

    from guardfl.inspect import inspect_model
    from guardfl.redteam.attacks.malicious.fishing import FishingConfig, fishing_model
    from guardfl.redteam.modality.image.models import LeNetZhu

    torch.manual_seed(0)
    model = LeNetZhu((1, 25, 25), 10)
    assert not inspect_model(fishing_model(model, 10, 3, 50.0), model).ok
    assert inspect_model(fishing_model(model, 10, 3, 50.0, disguise=True), model).ok
    with pytest.raises(ValueError, match="set strategy: class"):
        FishingConfig(disguise=True)
    with pytest.raises(ValueError, match="beta"):
        FishingConfig(disguise=True, strategy="class", beta=1000.0)


def test_the_dsnr_check_refuses_the_boosted_top_trap_and_the_median_trap_passes_it(tmp_path, capsys):
    """configs/research/malicious-adaptive-dsnr.yaml: a client that inspects with SEER's D-SNR check on
    (client.inspect_disaggregation) and prunes its gradient; the certificate states the check, the boosted
    trap at the top of the measurement is refused by it, the boosted trap around the median passes every
    check and reads faces exactly through GradPrune 0.9, and the trap sized on shadows of the client reads
    more."""
    assert main(["redteam", "--config", str(CONFIGS / "malicious-adaptive-dsnr.yaml"), "--out", str(tmp_path),
                 "--quiet", "--workers", "1"]) == 3  # one update decides nothing: INCONCLUSIVE
    out = capsys.readouterr().out
    assert "[info] the client inspects every received model" in out and "disaggregation (SEER's D-SNR" not in out
    assert "the disaggregation check (SEER's D-SNR (Garov et al. 2024), train mode: refused above 2" in out
    cert = __import__("json").loads((tmp_path / "certificate.json").read_text())
    assert leaked(cert) > 0 and cert["config"]["client"]["inspect_disaggregation"] is True
    assert cert["client"]["inspection"]["disaggregation"] and "disaggregation" in cert["client"]["inspection"]["checks"]
    assert "parallel_rows" in cert["client"]["inspection"]["checks"]
    by = {(r["attack"], r["budget"].get("cuts", "top"), r["budget"].get("rows")): r for r in cert["results"]}
    assert by[("robbing_the_fed", "top", None)]["info"]["refused"].startswith("architecture:")
    assert "disaggregation:" in by[("trap_weights", "top", 2)]["info"]["refused"]
    middle = by[("trap_weights", "middle", "auto")]  # its column noise (against shared columns) costs a little: SSIM 0.945
    assert "refused" not in middle["info"] and middle["recovered"]["above_max_ssim"] >= 1
    assert max(p["ssim"] for p in middle["metrics"]["per_image"]) > 0.9
    # sized on a shadow that runs the same checks, D-SNR included, a boosted trap at the top passes them all
    # and reads more than the median trap: 4 chains of 6 rows, 7 faces exactly (docs section 11)
    fitted = by[("trap_weights", "top", "fit")]
    assert "refused" not in fitted["info"] and fitted["recovered"]["exact"] >= 3 and fitted["info"]["boost"] == "1000.0"
    assert "disaggregation" in (tmp_path / "report.html").read_text()


def test_without_dsnr_the_certificate_says_it_was_not_run():
    from guardfl.redteam.certification.batches import inspection_summary

    off = inspection_summary(False)
    assert "disaggregation" not in off["checks"] and off["not_run"][0].startswith("disaggregation (SEER's D-SNR, opt-in")


def test_inspect_disaggregation_without_inspection_is_one_line(tmp_path, capsys):
    cfg = yaml.safe_load((CONFIGS / "malicious-adaptive-dsnr.yaml").read_text())
    cfg["client"]["inspect"] = False
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["redteam", "--config", str(path), "--out", str(tmp_path / "o"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "inspect_disaggregation: true adds a check" in err and "set inspect: true" in err
