"""The defense as the attacker builds it from the configuration it knows (Inter-InstaHide with its own partners).

The attacker knows a client's defense configuration, never its randomness nor its files: it builds the
defense from the configuration (seeds removed by the caller, ``threat.unseeded``), and an Inter-InstaHide
leaf mixes with the attacker's own partner images instead of the client's ``public`` file.
"""

from __future__ import annotations

from torch import Tensor

from guardfl.defenses import Defense, DefenseConfig, Stack, from_config
from guardfl.defenses.encoding import InstaHide
from guardfl.defenses.stack import StackConfig
from guardfl.errors import ConfigError


def _inter_instahide(config: DefenseConfig) -> bool:
    return any(leaf.kind == "instahide" and leaf.mode == "inter" for leaf in config.leaves())


def attacker_defense(config: DefenseConfig, public: Tensor | None) -> Defense:
    """The defense of ``config`` as the attacker builds it: from the configuration, except that an
    Inter-InstaHide leaf mixes with ``public`` (the attacker's partners) instead of loading the client's
    ``public`` file. ConfigError when such a leaf has no ``public``."""
    if not _inter_instahide(config):
        return from_config(config)
    if isinstance(config, StackConfig):
        return Stack(*[attacker_defense(m, public) for m in config.defenses], nonfinite=config.nonfinite, seed=config.seed)
    if public is None:
        raise ConfigError("instahide.public: mode 'inter' mixes with a public set the attacker does not hold; pass "
                          "public= (the attacker's stand-in partners, e.g. its auxiliary images, or the client's set "
                          "when the attacker holds it)")
    return InstaHide(public=public, **config.model_dump(mode="json", exclude={"kind", "public"}))
