"""The report's bound section: the sentence, the facts and the curves' picture."""

from pathlib import Path

from guardfl.redteam.certification.bound import certificate_bound
from guardfl.redteam.config import load_config
from guardfl.redteam.reports.bound import bound_html


def test_the_section_has_the_sentence_the_facts_and_the_picture():
    cfg = load_config({"client": {"batch_size": 4, "max_rounds": 8}, "defense": {"kind": "dpsgd", "noise_multiplier": 4.0},
                       "certify": {"max_updates": 1}})
    entry = certificate_bound(cfg, 0.01, "certify.kappa")
    page = bound_html(entry, "CERTIFIED")
    assert "CERTIFIED and" in page and "data:image/png;base64," in page and "round budget 8" not in page
    assert "Proven bound" in page and "add/remove-one" in page
    assert bound_html(None, "CERTIFIED") == ""
    none = bound_html(certificate_bound(load_config(Path(__file__).resolve().parents[3] / "configs/no-defense.yaml"), 0.01, "x"), "NOT CERTIFIED")
    assert "NO MECHANISM" in none and "<img" not in none
