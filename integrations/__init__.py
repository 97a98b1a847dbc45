"""Framework adapters, installed as ``guardfl.integrations``; no defense logic lives here.

- ``guardfl.integrations.round``: ``client_round``, the one client training round (protect, local steps,
  the update) that ``local_update`` and the red team's ``simulate_client`` both run; ``FedSGD`` / ``FedAvg``.
- ``guardfl.integrations.torch``: ``local_update`` (one defended FL round of a plain PyTorch loop, the
  model delta back) and ``ClientState`` (what a client keeps between rounds: round counter, DP accountant).
- ``guardfl.integrations.update``: ``UpdateDefense``, defenses on the model delta after training.
- ``guardfl.integrations.flower``: Flower's Message API (``train`` helper for ``@app.train()``,
  ``GuardUpdateMod``) and a legacy ``GuardedNumPyClient``; needs ``pip install 'guardfl[flower]'``.
- ``guardfl.integrations.nvflare``: NVIDIA FLARE (``GuardUpdateFilter``, a task-result filter, and
  ``GuardedTrainer`` for the Client API); needs ``pip install 'guardfl[nvflare]'``.
"""
