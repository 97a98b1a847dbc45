"""The plan's typed config copies: ``--samples`` changes certify.max_updates on the validated config."""

from __future__ import annotations

from pathlib import Path

import pytest

from guardfl.errors import ConfigError
from guardfl.redteam.certification.plan import with_samples
from guardfl.redteam.config import load_config
from guardfl.yamlio import load_yaml

_ROOT = Path(__file__).resolve().parents[3] / "configs"
#: every shipped red-team config: the starters at the top, papers/ and research/ (defenses/ holds defense configs)
CONFIGS = sorted(p for p in _ROOT.rglob("*.yaml") if p.relative_to(_ROOT).parts[0] != "defenses"
                 and "base" not in (load_yaml(p) or {}))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_samples_change_only_the_batch_count_of_every_shipped_config(path):
    """Target configs included: a dump-and-reload filled their data section, which a target refuses."""
    cfg = load_config(path)
    out, warnings = with_samples(cfg, 3)
    assert out.certify.max_updates == -(-3 // cfg.client.n)
    before, after = cfg.model_dump(mode="json"), out.model_dump(mode="json")
    before["certify"].pop("max_updates"), after["certify"].pop("max_updates")
    assert before == after and len(warnings) == 1 and "--samples 3" in warnings[0]
    assert with_samples(cfg, None) == (cfg, [])


@pytest.mark.parametrize("bad", [0, -1, True, 2.5, "3"])
def test_samples_must_be_a_positive_integer(bad):
    with pytest.raises(ConfigError, match=r"^samples: expected an integer >= 1"):
        with_samples(load_config(CONFIGS[0]), bad)
