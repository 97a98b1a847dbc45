"""Gradient-inversion attacks: one class each, ``reconstruct(observation, threat) -> Reconstruction``.

>>> from guardfl.redteam import attacks
>>> attack = attacks.get("inverting_gradients", iterations=500, restarts=4)
"""

from guardfl.redteam.attacks.base import Attack, AttackConfig, AttackFailed, Capabilities, NotApplicable, Reconstruction
from guardfl.redteam.attacks.labels import infer_labels
from guardfl.redteam.attacks.analytic.exclusive_neurons import ExclusiveNeurons
from guardfl.redteam.attacks.prepared import PreparedCache
from guardfl.redteam.attacks.setting import Setting
from guardfl.redteam.attacks.analytic.cocktail_party import CocktailParty
from guardfl.redteam.attacks.optimisation.dlg import DLG, IDLG
from guardfl.redteam.attacks.text.embedding_readout import EmbeddingReadout
from guardfl.redteam.attacks.malicious.fishing import Fishing
from guardfl.redteam.attacks.optimisation.gradinversion import GradInversion
from guardfl.redteam.attacks.optimisation.inverting_gradients import InvertingGradients
from guardfl.redteam.attacks.analytic.prior_aware import PriorAware
from guardfl.redteam.attacks.learned.learned_inversion import LearnedInversion
from guardfl.redteam.attacks.registry import ATTACKS, available, get
from guardfl.redteam.attacks.malicious.robbing_the_fed import RobbingTheFed
from guardfl.redteam.attacks.malicious.seer import Seer
from guardfl.redteam.attacks.malicious.server import ServerAttack
from guardfl.redteam.attacks.malicious.sign_bits import SignBits
from guardfl.redteam.attacks.text.tag import TAG
from guardfl.redteam.attacks.malicious.threshold_bins import ThresholdBins
from guardfl.redteam.attacks.malicious.trap_weights import TrapWeights

__all__ = [
    "ATTACKS",
    "DLG",
    "EmbeddingReadout",
    "ExclusiveNeurons",
    "IDLG",
    "Attack",
    "AttackConfig",
    "AttackFailed",
    "Capabilities",
    "CocktailParty",
    "Fishing",
    "LearnedInversion",
    "NotApplicable",
    "PriorAware",
    "PreparedCache",
    "Setting",
    "GradInversion",
    "InvertingGradients",
    "Reconstruction",
    "RobbingTheFed",
    "Seer",
    "ServerAttack",
    "SignBits",
    "TAG",
    "ThresholdBins",
    "TrapWeights",
    "available",
    "get",
    "infer_labels",
]
