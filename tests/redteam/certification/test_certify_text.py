"""Certifying a text client end to end: the certificate carries text metrics and judges them with the text
thresholds (never the image ones), the prior guess and the report show sentences, ``attacks: all`` lists
the image attacks as not applicable, a classifier's labels are restored, a resume gives the same
certificate; bad text input is one line naming the field, through the API and the CLI (exit 2).

transformer3 is 10.7M parameters (the GPT-2 vocabulary); with seq_len 8, one or two client updates and a
few TAG iterations one run takes 5-15 s on one thread. ``threads=1``: the default (``job_threads``) gives
a model this size two intra-op threads, which on a busy two-core machine made one TAG iteration 3.3 s
instead of 0.15 s."""

import html
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from guardfl.cli import main
from guardfl.errors import ConfigError
from guardfl.redteam.attacks import ATTACKS
from guardfl.redteam.attacks.text.tag import TAG
from guardfl.redteam.certification.run import certify
from guardfl.redteam.certification.certificate import untimed
from guardfl.redteam.config import load_config

TEXT_METRICS = {"token_acc", "bag", "rouge1", "rouge2", "rougeL", "text", "recon_text"}

#: the population: the first 400 windows of 8 tokens of the built-in text; the attacker's text after it
LEAK = {
    "model": {"name": "transformer3"},
    "data": {"source": "text", "seq_len": 8, "limit": 400},
    "aux": {"source": "text", "offset": 400, "limit": 200},
    "attacks": [{"name": "tag", "budget": {"iterations": 20}}],
    # every recovered word or position counts, and absolutely (no margin over the prior guess)
    "certify": {"max_rouge1": 0.0, "max_token_acc": 0.0, "prior_margin": None, "max_updates": 2},
}


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(a[k], v) if isinstance(v, dict) and isinstance(a.get(k), dict) else v
    return out


@pytest.fixture(scope="module")
def leak_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("leak") / "out"
    return certify(LEAK, out=out, threads=1), out


def test_results_carry_text_metrics_and_a_leak_is_not_certified(leak_run):
    cert, out = leak_run
    assert cert.verdict == "NOT CERTIFIED" and not cert.certified
    assert [r["attack"] for r in cert.results] == ["tag", "tag"] and [r["batch"] for r in cert.results] == [0, 1]
    for r in cert.results:
        (row,) = r["metrics"]["per_image"]
        assert TEXT_METRICS <= set(row) and not {"ssim", "psnr", "lpips"} & set(row)
        assert 0 <= row["token_acc"] <= 1 and 0 <= row["bag"] <= 1 and 0 <= row["rouge1"] <= 1
        assert set(r["metrics"]["summary"]) >= {"token_acc", "bag", "rouge1"}
        assert r["threat"]["labels"] == "inferred" and r["info"]["labels"] == "tied" and int(r["info"]["bag"]) >= 1
        assert set(r["recovered"]) == {"above_max_rouge1", "exact", "of", "fraction"} and r["recovered"]["of"] == 1
        assert cert.reconstructions[r["job"]].shape == (1, 8)
    assert [w["metric"] for w in cert.worst] == ["rouge1", "token_acc"]  # the text thresholds only
    (check,) = cert.checks
    assert check["metric"] == "leak_rate" and check["status"] == "NOT CERTIFIED"
    leaked = cert.evidence["leak_rate"]["leaked"]
    assert leaked >= 1 and cert.evidence["per_attack"]["tag"]["leaked"] == leaked
    assert set(cert.evidence["per_attack"]["tag"]["by_metric"]) == {"rouge1", "token_acc"}
    assert cert.evidence["per_class"] == []  # a causal LM's targets are its text: no classes
    assert cert.population["source"] == "text" and cert.population["size"] == 400


def test_the_prior_guess_is_measured_when_aux_is_given(leak_run):
    cert, _ = leak_run
    assert set(cert.priors) == {"0", "1"}
    for b in (0, 1):
        (row,) = cert.priors[str(b)]
        assert {"token_acc", "rouge1", "bag"} <= set(row)
        prior = cert.reconstructions[f"b{b}-prior"]
        assert prior.shape == (1, 8) and not prior.is_floating_point()
    assert cert.reconstructions["b0-prior"].equal(cert.reconstructions["b1-prior"])  # no update used


def test_report_and_certificate_show_the_sentences(leak_run):
    cert, out = leak_run
    saved = json.loads((out / "certificate.json").read_text())
    assert saved["verdict"] == "NOT CERTIFIED" and saved["results"][0]["metrics"]["per_image"][0]["text"]
    page = (out / "report.html").read_text()
    assert "NOT CERTIFIED" in page and "tag" in page and "prior guess" in page
    for r in cert.results:
        assert html.escape(r["metrics"]["per_image"][0]["text"]) in page  # the original sentence
    assert '<span class="hit">' in page or '<span class="bag">' in page  # recovered tokens highlighted
    assert ".hit {" in page and "grid-batch" not in page and "Every attacked sample" not in page  # text, no image grids
    assert not list(out.glob("grid-batch*.png"))


def test_a_resumed_text_certificate_is_the_uninterrupted_one(leak_run, tmp_path, kill_attack_at):
    whole, whole_out = leak_run
    attacks = kill_attack_at(2)  # killed as the second client update's attack starts
    with pytest.raises(KeyboardInterrupt):
        certify(LEAK, out=tmp_path / "r", threads=1, attacks=attacks)
    assert (tmp_path / "r" / "state" / "b0-0-tag.json").is_file()
    assert not (tmp_path / "r" / "certificate.json").exists()
    resumed = certify(LEAK, out=tmp_path / "r", resume=True, threads=1)
    a, b = (json.loads((d / "certificate.json").read_text()) for d in (whole_out, tmp_path / "r"))
    assert untimed(a) == untimed(b)
    for key, tensor in whole.reconstructions.items():
        assert tensor.equal(resumed.reconstructions[key]), key


def test_text_thresholds_judge_text_and_image_thresholds_are_ignored():
    cfg = {
        "model": {"name": "transformer3"},
        "data": {"source": "text", "seq_len": 8, "limit": 400},
        "attacks": [{"name": "tag", "budget": {"iterations": 5}}],
        # nothing passes these image thresholds; nothing can exceed the text ones (capped at 1)
        "certify": {"max_rouge1": 1.0, "max_rouge2": 1.0, "max_token_acc": 1.0, "max_ssim": -1.0, "max_psnr": 0.001,
                    "min_lpips": 1e6, "max_updates": 1},
    }
    cert = certify(cfg, threads=1)
    assert cert.verdict == "INCONCLUSIVE"  # no leak, but 1 update cannot support a 5% claim
    assert [c["metric"] for c in cert.checks] == ["leak_rate"]  # no LPIPS check for text
    assert [w["metric"] for w in cert.worst] == ["rouge1", "rouge2", "token_acc"]
    assert not any(w["exceeds"] for w in cert.worst)
    assert cert.evidence["leak_rate"]["leaked"] == 0
    assert any("cannot support the leak rate claim" in w for w in cert.warnings)


def test_attacks_all_lists_the_image_attacks_as_not_applicable(monkeypatch):
    monkeypatch.setitem(TAG.budgets, "quick", {"iterations": 5})
    cfg = {"model": {"name": "transformer3"}, "data": {"source": "text", "seq_len": 8, "limit": 400},
           "attacks": "all", "strength": "quick", "certify": {"max_updates": 1}}
    cert = certify(cfg, threads=1)
    lines = {line["attack"]: line for line in cert.attacks}
    assert set(lines) == set(ATTACKS)
    assert lines["tag"]["status"] == "ran" and lines["tag"]["budget"] == {"iterations": 5}
    # a causal LM's labels are its private text: even the strongest threat does not grant them
    assert lines["tag"]["threat"]["labels"] == "inferred"
    image_only = [name for name, cls in ATTACKS.items() if "text" not in cls.capabilities.modalities]
    assert {"dlg", "idlg", "inverting_gradients", "robbing_the_fed"} <= set(image_only)
    for name in image_only:
        assert lines[name]["status"] == "not applicable" and "image" in lines[name]["reason"], lines[name]
    assert "tag" in [r["attack"] for r in cert.results]
    # the analytic readout needs no budget and no auxiliary text: it runs in every text certificate
    assert lines["embedding_readout"]["status"] == "ran"
    assert "embedding_readout" in [r["attack"] for r in cert.results]


def test_a_text_classifier_on_labelled_sentences_restores_labels():
    cfg = {"model": {"name": "text-classifier", "num_classes": 2},
           "data": {"source": "labelled-text", "seq_len": 8, "limit": 200},
           "attacks": [{"name": "tag", "budget": {"iterations": 10}}], "certify": {"max_updates": 1}}
    cert = certify(cfg, threads=1)
    (r,) = cert.results
    assert r["threat"]["labels"] == "inferred" and r["info"]["labels"] == "inferred"
    summary = r["metrics"]["summary"]
    assert summary["label_acc"] == 1.0  # one sample: the output layer's gradient names its class
    assert r["metrics"]["per_image"][0]["label_correct"] is True and "rouge1" in summary
    (cls,) = cert.evidence["per_class"]
    assert cls["samples"] == 1
    assert cert.verdict in ("NOT CERTIFIED", "INCONCLUSIVE")


# ------------------------------------------------------------------------------------------ bad input
TEXT = {"model": {"name": "transformer3"}, "data": {"source": "text", "seq_len": 8, "limit": 50},
        "attacks": [{"name": "tag", "budget": {"iterations": 1}}], "certify": {"max_updates": 1}}


def _bad_files(tmp_path: Path) -> None:
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "binary.txt").write_bytes(b"PK\x03\x04\x00\x00binary\x00\xff")
    (tmp_path / "otherlm.py").write_text(
        "from guardfl.redteam.modality.text.models import Transformer3\n\n"
        "def make():\n    return Transformer3(vocab_size=1000, context=64)\n")


BAD = [  # (patch, the field the one line names, a fragment of the reason)
    ({"data": {"tokenizer": "nope"}}, "data.tokenizer", "'nope' not found"),
    ({"data": {"path": "{tmp}/empty.txt"}}, "data.path", "has no text"),
    ({"data": {"path": "{tmp}/binary.txt"}}, "data.path", "not UTF-8 text"),
    ({"data": {"seq_len": 300}}, "data.seq_len", "context (256)"),
    ({"model": {"name": "otherlm:make"}}, "data.tokenizer", "the model's embedding 1000"),
    ({"model": {"name": "lenet"}}, "model.name", "lenet is an image model"),
    ({"data": {"source": "lfw-faces", "limit": None}, "attacks": [{"name": "dlg"}]}, "model.name",
     "transformer3 is a text model"),
    ({"aux": {"source": "lfw-faces"}}, "aux.source", "is images"),
    ({"defense": {"kind": "mixup"}}, "defense", "mixup mixes images"),
    ({"defense": {"kind": "instahide"}}, "defense", "instahide mixes images"),
    ({"model": {"name": "text-classifier"}}, "data.source", "a classifier trains on labelled sentences"),
]
IDS = ["tokenizer", "empty-file", "binary-file", "seq-len", "vocabulary", "image-model-text-data",
       "text-model-image-data", "aux-images", "mixup", "instahide", "classifier-plain-text"]


def _config(patch: dict, tmp_path: Path) -> dict:
    text = json.dumps(patch).replace("{tmp}", str(tmp_path))
    return _merge(TEXT, json.loads(text))


@pytest.fixture
def bad_env(tmp_path, monkeypatch):
    _bad_files(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("otherlm", None)
    return tmp_path


@pytest.mark.parametrize("patch, field, fragment", BAD, ids=IDS)
def test_bad_text_input_is_one_line_naming_the_field(bad_env, capsys, patch, field, fragment):
    cfg = _config(patch, bad_env)
    with pytest.raises(ValueError) as info:  # ConfigError (DataError for the data source)
        certify(load_config(cfg), threads=1)
    msg = str(info.value)
    assert "\n" not in msg and field in msg and fragment in msg, msg
    assert msg.split(":")[0] in (field, "config") and f"{field}:" in msg, msg  # the field leads the line

    path = bad_env / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = bad_env / "out"
    code = main(["redteam", "--config", str(path), "--out", str(out), "--quiet"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0 and field in err and fragment in err, err
    assert not (out / "certificate.json").exists()


def test_config_time_mismatches_fail_in_load_config():
    for patch, field in (({"model": {"name": "lenet"}}, "model.name"), ({"aux": {"source": "cifar10"}}, "aux.source"),
                         ({"data": {"source": "mnist"}}, "model.name")):
        with pytest.raises(ConfigError, match=field) as info:
            load_config(_merge(TEXT, patch))
        assert "\n" not in str(info.value)


def test_the_console_script_exits_2_with_one_line(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(_merge(TEXT, {"data": {"tokenizer": "nope"}})))
    run = subprocess.run([sys.executable, "-m", "guardfl", "redteam", "--config", str(path), "--out",
                          str(tmp_path / "o"), "--quiet"], capture_output=True, text=True)
    err = run.stderr.strip()
    assert run.returncode == 2 and err.count("\n") == 0 and "data.tokenizer" in err, err
    assert not (tmp_path / "o" / "certificate.json").exists()


def test_the_shipped_text_default_does_not_certify_against_the_readout_alone():
    """configs/text-default.yaml as shipped (population, aux, thresholds), with only its analytic attack
    (the full run adds TAG and learned inversion: minutes): every sequence leaks."""
    cfg = yaml.safe_load((Path(__file__).resolve().parents[3] / "configs" / "text-default.yaml").read_text())
    cfg["attacks"] = ["embedding_readout"]
    cert = certify(cfg, threads=1)
    assert cert.verdict == "NOT CERTIFIED"
    assert cert.evidence["leak_rate"]["leaked"] == cert.evidence["leak_rate"]["samples"] == 4
