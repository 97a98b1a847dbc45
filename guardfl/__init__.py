"""guardfl: drop-in defenses for federated-learning clients against gradient inversion.

>>> import torch, guardfl
>>> model = torch.nn.Linear(4, 2)
>>> opt = guardfl.wrap(torch.optim.SGD(model.parameters(), lr=0.1), guardfl.defenses.Outpost())
"""

from guardfl import bounds, defenses
from guardfl._version import __version__
from guardfl.bounds import calibrate
from guardfl.defenses import from_config
from guardfl.errors import ConfigError, GuardflError, MaliciousModelError, NonFiniteGradientError, RoundBudgetError, StateFileError, UndefendedUpdateError, UnsupportedOptimizerError
from guardfl.inspect import Inspection, inspect_model
from guardfl.inspect_history import LeakHistory
from guardfl.optimizer import GuardedOptimizer, wrap
from guardfl.protect import PrivateOptimizer, dp_compatible, load_plain_state_dict, plain_state_dict, protect, soft_cross_entropy
from guardfl.stats import LayerStats, StageStats, StepStats

__all__ = [
    "ConfigError",
    "GuardedOptimizer",
    "GuardflError",
    "Inspection",
    "LayerStats",
    "LeakHistory",
    "MaliciousModelError",
    "NonFiniteGradientError",
    "PrivateOptimizer",
    "RoundBudgetError",
    "StateFileError",
    "StageStats",
    "StepStats",
    "UndefendedUpdateError",
    "UnsupportedOptimizerError",
    "__version__",
    "bounds",
    "calibrate",
    "defenses",
    "dp_compatible",
    "inspect_model",
    "load_plain_state_dict",
    "plain_state_dict",
    "protect",
    "soft_cross_entropy",
    "from_config",
    "wrap",
]
