"""A malicious server in the certificate: ``threat.server: malicious`` runs the attacks that send the
client a model of their own making; an honest-server certificate lists them as not applicable."""

from pathlib import Path

import pytest
import yaml

from guardfl.cli import main
from guardfl.redteam.certify import certify

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_robbing_the_fed_breaks_the_undefended_client_and_gradprune_certifies():
    plain = certify(str(CONFIGS / "malicious-rtf.yaml"))
    assert plain.status == "NOT CERTIFIED"
    (record,) = plain.results
    assert record["attack"] == "robbing_the_fed" and record["threat"]["server"] == "malicious"
    assert record["recovered"]["exact"] >= 40 and record["info"]["queries"] == "1"
    assert record["info"]["malicious_model"] == "Imprinted"  # the crafted model, named in the record
    pruned = certify(str(CONFIGS / "malicious-rtf-gradprune.yaml"))
    assert pruned.status == "CERTIFIED" and pruned.results[0]["recovered"]["exact"] == 0


def test_fishing_breaks_the_undefended_client_in_train_mode():
    cfg = yaml.safe_load((CONFIGS / "malicious-fishing.yaml").read_text())
    cfg["attacks"][0]["budget"] = {"iterations": 300, "restarts": 2}
    cert = certify(cfg)
    assert cert.status == "NOT CERTIFIED" and cert.evidence["leaked_samples"]
    assert {r["info"]["queries"] for r in cert.results} == {"2"}
    assert all(r["info"]["client_mode"] == "train" for r in cert.results)


def test_attacks_all_is_the_honest_server_certificate_and_lists_it_as_not_applicable():
    import torch

    from guardfl.redteam import simulate_client
    from guardfl.redteam.attacks import Setting
    from guardfl.redteam.certify import plan_attacks
    from guardfl.redteam.config import load_config
    from guardfl.redteam.models import LeNetZhu

    cfg = load_config({"model": {"name": "lenet"}, "data": {"source": "lfw-faces"}, "client": {"batch_size": 1},
                       "certify": {"batches": 1}})
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
