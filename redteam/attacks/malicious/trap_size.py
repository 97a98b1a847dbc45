"""How large and how loud a trap the client's known defense lets through (``trap_weights``' ``rows: auto`` and
``boost: auto``): pure functions of the defense's configuration and the layer's geometry.

A boosted trap's rows carry the first layer's largest gradients (their classifier columns ``TRAP_BOOST``
times the honest ones), so a pruning that keeps a layer's largest entries keeps the trap's rows first, but
only as many of them as it keeps entries. GradPrune 0.99 on FC-2's first layer (256 x 625 on 25 x 25
faces) keeps 1,600 weight entries and 3 bias entries: two whole rows. A trap of 6 or 8 rows there is cut to
two and a partial third, and its bins come back blurred; a trap of two rows survives whole and reads one
sample exactly when one sample falls between its cuts (measured: 4 of 5 trap seeds, 64 LFW faces, the
client inspecting with the D-SNR check on; README "Checks against constructions").
"""

from __future__ import annotations

from guardfl.defenses import DefenseConfig
from guardfl.ops.selection import prune_count
from guardfl.redteam.attacks.malicious.server import pruning_stages
from guardfl.redteam.threat import defense_kinds

#: the boost "auto" uses against a known pruning or noise defense (see ``TrapWeightsConfig.boost``): the
#: value the shipped configs' boosted traps use
TRAP_BOOST = 1000.0

#: rows per chain of ``rows: auto`` where no pruning limits them: the median trap of 6 rows passed every
#: check, D-SNR and isolation included, on 10 of 10 CIFAR-10 batches of 64 (8 rows: 8 of 10)
AUTO_ROWS = 6


def boost_for(defense_config: DefenseConfig | dict | None) -> float:
    """``TRAP_BOOST`` when the client's defense (any stage of a stack) prunes the update by magnitude
    (GradPrune, Outpost) or adds noise of a scale that does not follow the gradient's (Gaussian, Laplace,
    Outpost), else 1 (sign compression keeps no magnitude; DP-SGD clips each sample's gradient first)."""
    kinds = {leaf.kind for leaf in defense_kinds(defense_config)}
    return TRAP_BOOST if kinds & {"gradprune", "outpost", "gaussian", "laplace"} else 1.0


def kept_rows(defense_config: DefenseConfig | dict | None, units: int, inputs: int, parameters: int) -> int | None:
    """How many whole rows (``inputs`` weights and a bias each) of a ``units x inputs`` first layer the
    defense's pruning keeps when they are the layer's largest gradients, or None when no stage prunes.

    Per layer (GradPrune ``scope: layer``, Outpost's ``prune``): the weight keeps ``n - ceil(ratio (n - 1))``
    of its ``n = units x inputs`` entries and the bias as many of its ``units``; a row needs both.
    GradPrune ``scope: global`` keeps that share of all ``parameters`` of the model. Stages apply one after
    the other, so the smallest count binds."""
    counts = [_kept(ratio, parameters) // (inputs + 1) if scope == "global"
              else min(_kept(ratio, units * inputs) // inputs, _kept(ratio, units))
              for ratio, scope in pruning_stages(defense_config)]
    return min(counts) if counts else None


def _kept(ratio: float, numel: int) -> int:
    return numel - prune_count(float(ratio), numel)


def auto_rows(defense_config: DefenseConfig | dict | None, units: int, inputs: int, parameters: int, chains: int,
              cuts: str) -> tuple[int, int, str]:
    """Chains and rows per chain for ``rows: auto``, and the certificate's line on why: ``chains`` chains of
    ``AUTO_ROWS`` rows, or fewer rows (and, when even those do not fit, fewer chains) so that what a known
    pruning keeps (``kept_rows``) holds every row whole; never fewer than one chain of the rows a bin needs
    (two around the median, one at the top)."""
    least = 2 if cuts == "middle" else 1
    kept = kept_rows(defense_config, units, inputs, parameters)
    if kept is None:
        return chains, AUTO_ROWS, f"{AUTO_ROWS} (auto: no known pruning to fit)"
    fitted = max(1, min(chains, kept // least))
    rows = max(least, min(AUTO_ROWS, kept // fitted))
    fits = "all whole" if rows * fitted <= kept else "not all whole: the fewest that make a bin"
    return fitted, rows, (f"{rows} (auto: the pruning keeps {kept} whole row(s) of the first layer; {fitted} of "
                          f"{chains} chain(s), {fits})")
