"""The client defenses the malicious-server benches (``bench_exclusive_neurons.py``, ``bench_seer.py``) run
their attacks through: one table, so that their figures are taken against the same settings."""

#: name -> the defense's configuration (None: undefended)
DEFENSES = {
    "none": None,
    "gaussian 0.01": {"kind": "gaussian", "sigma": 0.01},
    # the update clipped to norm 10 before the noise (an honest fc2bn update of 8 CIFAR-10 images: ~16, of 64: ~6)
    "gaussian 0.01 clip 10": {"kind": "gaussian", "sigma": 0.01, "clip": 10.0},
    "gaussian 0.01 clip 1": {"kind": "gaussian", "sigma": 0.01, "clip": 1.0},
    "gradprune 0.9": {"kind": "gradprune", "ratio": 0.9},
    "gradprune 0.99": {"kind": "gradprune", "ratio": 0.99},
    "sign": {"kind": "sign"},
    "outpost": {"kind": "outpost"},
    "soteria": {"kind": "soteria"},
    "dpsgd 1.0": {"kind": "dpsgd", "noise_multiplier": 1.0, "max_grad_norm": 1.0},
}
