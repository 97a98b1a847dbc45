"""DP-SGD accounting for a certified deployment: the (epsilon, delta) the configured client spends.

The red team attacks one round of one client, but a DP guarantee is a property of the whole training:
Opacus's accountant over ``epochs`` passes of the client's local dataset at sample rate
``batch_size / dataset_size``. ``resolve`` turns a ``target_epsilon`` configuration into the noise
multiplier Opacus's ``make_private_with_epsilon`` would pick for that deployment (so the simulated client
adds exactly that noise) and reports the epsilon of a ``noise_multiplier`` configuration.

The DP-SGD config bounds (``guardfl.defenses.dpsgd``: a finite noise multiplier in [0, 1000], a finite
target epsilon in (0, 100]) keep both accountants quick here: ``noise_multiplier: .inf`` hung the RDP
accountant and ``target_epsilon: .inf`` silently became noise multiplier 10. A noise multiplier of 0
(clipping only) has no epsilon: the summary says so instead of asking the accountant.
"""

from __future__ import annotations

import warnings
from typing import Any

from guardfl.config import validate
from guardfl.defenses import DefenseConfig, parse_config
from guardfl.errors import ConfigError


def resolve(defense: DefenseConfig | dict | None, batch_size: int, dataset_size: int | None,
            ) -> tuple[DefenseConfig | None, dict[str, Any] | None]:
    """(the parsed defense configuration with DP-SGD's noise multiplier resolved, the privacy summary);
    the configuration as parsed and None without a DP-SGD stage (None for no defense). The DP-SGD stage is
    the first of the configuration's ``leaves()``; the resolved configuration is the parsed one with that
    leaf replaced (``DefenseConfig.map_leaves``); the caller's is left alone."""
    if not defense:
        return None, None
    parsed = parse_config(defense)
    leaf = next((leaf for leaf in parsed.leaves() if leaf.kind == "dpsgd"), None)  # the first DP-SGD stage
    if leaf is None:
        return parsed, None
    dp = leaf.model_dump(mode="json")
    from opacus.accountants import create_accountant
    from opacus.accountants.utils import get_noise_multiplier

    accountant = dp.get("accountant", "rdp")
    delta = float(dp.get("delta", 1e-5))
    epochs = dp.get("epochs")
    if dataset_size is None:
        if dp.get("target_epsilon") is not None:
            raise ConfigError("client.dataset_size: needed to turn dpsgd.target_epsilon into a noise multiplier (the "
                              "client's local dataset size; sample rate = batch_size / dataset_size)")
        return parsed, {"epsilon": None, "note": "give client.dataset_size and dpsgd.epochs to account epsilon",
                         "noise_multiplier": dp["noise_multiplier"], "max_grad_norm": dp.get("max_grad_norm", 1.0)}
    if dataset_size < batch_size:
        raise ConfigError(f"client.dataset_size: {dataset_size} is smaller than the batch size {batch_size}; allowed: >= batch size")
    rate = batch_size / dataset_size
    warnings.filterwarnings("ignore", message=".*Optimal order is the largest alpha.*")  # Opacus's RDP search note
    if dp.get("target_epsilon") is not None:
        dp["noise_multiplier"] = float(get_noise_multiplier(target_epsilon=dp["target_epsilon"], target_delta=delta,
                                                            sample_rate=rate, epochs=epochs, accountant=accountant))
        dp["target_epsilon"] = None
    summary = {"noise_multiplier": dp["noise_multiplier"], "max_grad_norm": dp.get("max_grad_norm", 1.0),
               "sample_rate": rate, "epochs": epochs, "delta": delta, "accountant": accountant, "epsilon": None}
    if dp["noise_multiplier"] == 0:  # the PRV accountant raised OverflowError here, RDP took 2 s to say inf
        summary["note"] = "noise_multiplier 0 is clipping only: no privacy guarantee (epsilon is infinite)"
    elif epochs is not None:
        acc = create_accountant(accountant)
        acc.history = [(dp["noise_multiplier"], rate, int(epochs * dataset_size // batch_size))]
        summary["epsilon"] = float(acc.get_epsilon(delta))
    else:
        summary["note"] = "give dpsgd.epochs (passes over the local dataset) to account epsilon"
    resolved = validate(type(leaf), dp, "dpsgd")
    return parsed.map_leaves(lambda x: resolved if x is leaf else x), summary
