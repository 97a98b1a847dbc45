"""Learning To Invert (LTI; Wu et al. 2023): a network trained on auxiliary data to map what the client
transmits back to its private batch.

Preparation (once per setting, cached): the attacker's auxiliary images (in-distribution aux data, OOD
images, and LTI-OOD pseudo-images drawn from a Gaussian per DCT coefficient of the OOD images, Sec.
4.1.3; the last two with random labels) are grouped into batches of the client's size and pushed through
``TransmitSimulator``: the client's loss, BatchNorm mode and protocol (FedSGD gradient, or the FedAvg
delta of the simulated local steps), with the real guardfl defense built from the known configuration
and fresh randomness on every draw: the defense is data augmentation. The observations are optionally
count-sketched to ``hash_ratio`` of their size (Sec. 3.2; the paper's 0.5 for ResNet-20), standardised
per coordinate, and an MLP ``Linear(d, h)-ReLU-Linear(h, h)-ReLU-Linear(h, B*D)`` with a sigmoid into the
input range is trained with Adam on the MSE (Hungarian-matched over the batch for B > 1, Eq. 3; scipy's
``linear_sum_assignment``), learning rate x0.1 at 75% of the epochs (the paper: 150 of 200).

Reconstruction: one forward pass of the observed update through the trained network. Labels come from
the threat model as for every attack (granted, or restored from the output layer). ``reconstruct_many``:
one forward pass for all the observations.

Deviations and choices, stated:
- Fresh defense draws: the paper draws a new defended gradient for every minibatch; we regenerate the
  whole training set of observations (new batch groupings and new defense randomness) every
  ``refresh_every`` epochs (the paper budget: every epoch); deterministic defenses (none, sign, pruning)
  are generated once, since a redraw would repeat them.
- Observations are standardised per coordinate with statistics of the first training draw (part of the
  trained state, never of the private data); the paper feeds raw gradients. This only rescales the first
  layer's inputs, and it keeps one learning rate working across defenses whose outputs differ by orders
  of magnitude (a sign vector vs a 1e-4 FedAvg delta).
- ``flip`` (quick budget: on; the paper: off) mirrors a random half of the auxiliary training images at
  every draw, so a deterministic defense is redrawn too (every ``refresh_every`` epochs; each LeNet draw
  is a vmapped pass, ~1% of the training time), except one that reads the model per batch (Soteria: its
  one draw is flipped, not redrawn, since a draw costs minutes on a CPU). Only the attacker's own images are augmented. Measured
  (bench_lti's split, LeNet wide-init, B = 1, sign, quick budget, 500 held-out targets): MSE 0.040 ->
  0.037 at the same wall time. The quick inverter's last-epoch training MSE is close to its held-out
  MSE (0.036 vs 0.037 with flips, 0.037 vs 0.040 without): it underfits, so the gap to the paper's 0.014 is the budget (width 512 vs 3,000, 40 epochs of 4,050
  images vs 200 of 50,000), not overfitting to the auxiliary data. The quick budget is now 20 epochs (issue 64:
  the main job decides in a minute): on ``configs/default.yaml`` (Outpost, 2,136 auxiliary images) the held-out
  MSE went from 0.0109 to 0.0121 (the mean auxiliary image: 0.063) and the preparation from 84 s to 39 s on a
  busy 2-core machine (with Adam fused, itself 135 s -> 84 s at 40 epochs).
- ``hidden`` None is the paper's rule: 3,000 for B = 1, 10,000 for B > 1. The sigmoid output is used for
  every model (the paper states it for LeNet); images live in the client's input range.
- A held-out split of the auxiliary data (``holdout``) measures the inverter against the trivial guess
  (the mean auxiliary image); it is reported, and nothing is selected with it or with the private data
  (the public LTI code picks its best model on the test set; we keep the final one).
- The inverter learns label-dependent structure: classes missing from the in-distribution auxiliary data
  (``aux_classes_missing`` in the preparation record) are attacked poorly (measured: a CIFAR-10 inverter
  trained without trucks returned noise, MSE 0.31, on truck gradients), so that list bounds what the
  certificate says about those classes. OOD and pseudo-images carry random labels and do not fill it.
- The inverter cannot be trained for FedAvg with unknown local hyperparameters (threat fedavg=unknown):
  the attack declares itself not applicable there.
- Every defense kind is simulated as augmentation (``TransmitSimulator``, the same code as the client):
  gradient defenses and stacks; DP-SGD (Opacus's per-sample clipping, noise and expected batch size, the
  noise multiplier a ``target_epsilon`` resolves to, Poisson-sampled FedAvg steps); Soteria and GradDefense
  on each auxiliary batch with the replica's current weights (Soteria is deterministic: one draw); MixUp and
  InstaHide, where the pair learned is (update of the ENCODED auxiliary batch, the PRIVATE batch behind it),
  so the inverter answers with private images directly: the certificate hands it the observation itself and
  does not demix its answer (``Capabilities.inverts_encodings``), unlike the gradient attacks that
  reconstruct encodings first. Inter-InstaHide mixes with a public set: under ``threat.public_data:
  unknown`` (the attacker does not hold it) the attacker's own in-distribution auxiliary images stand in as
  partners and the client's file is never read; under ``known`` the simulated client mixes with the set the
  configuration names (``simulated_public``). Labels granted under an
  encoding are the client's soft labels; the answer labels each image with the class of most weight.
  MixUp / Intra-InstaHide inside Poisson-sampled DP-SGD FedAvg batches: each sampled batch is encoded
  within itself, and the rounds the client refuses (a sampled batch of 1 to k-1 images) are redrawn, since
  the client transmits only the rounds it completes.
- Cost of the simulation per auxiliary batch (LeNet of Zhu et al., CIFAR-10, B = 1, one thread on a busy
  2-core machine, ``bench/bench_simulator.py``): 1-2 ms for none, pruning, Outpost, DP-SGD and Inter-InstaHide
  (3.5 ms per batch of 4 for MixUp / Intra-InstaHide); GradDefense ~10 ms (every client's sensitivity in one
  double-backward pass, ``GradDefense.root_sensitivities``, then each client's slicing and noise); Soteria
  ~160 ms (one vector-Jacobian product per feature of the FC input, 768, for the whole chunk of batches at
  once: ``Soteria.column_masks``), drawn once. The quick preparation of ``configs/default.yaml`` (LFW, 2,136
  auxiliary images) with Soteria took 825 s at load 12 on 2 cores (held-out MSE 0.009 vs 0.063 for the
  mean auxiliary image: the convolutions Soteria leaves alone leak); with GradDefense (10 draws) 676 s at
  load 13 (held-out MSE 0.013).

Text clients (``Setting.modality == "text"``: token ids of a ``textmodels`` model): the same lifecycle
(one name, prepare once per setting with the cache, one forward pass per ``reconstruct_many``) with the
text maths of ``learned_inversion_text`` (Sec. 4.2: the per-position cross-entropy inverter, Hungarian
matching over sequences, chunked simulation hashed chunk by chunk, an output layer over the auxiliary
tokens, the token-embedding rows). It reads the ``text_*`` / ``token_hidden`` budget fields instead of
``hidden`` / ``epochs`` / ``batch`` / ``lr`` / ``lr_drop_at`` / ``refresh_every``, and ``text_hash_dim``
(else ``hash_dim``, else ``hash_ratio``, else the paper's 10%) for its hash; ``standardize``, ``holdout``
and the seed are shared. ``hash_dim`` (absolute, overrides ``hash_ratio``) serves both modalities.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F
from pydantic import Field
from scipy.optimize import linear_sum_assignment
from torch import Tensor, nn

from guardfl.defenses import DefenseConfig
from guardfl.redteam.attacks.base import DECODING_THREAT, Attack, AttackConfig, Capabilities, Reconstruction
from guardfl.redteam.attacks.labels import labels_for
from guardfl.redteam.attacks.setting import Setting, on_device
from guardfl.redteam.attacks.analytic.encoded import public_set
from guardfl.redteam.client.hashing import CountSketch
from guardfl.redteam.attacks.learned.inverter_training import holdout_split, standardiser, train_inverter
from guardfl.redteam.attacks.learned.learned_inversion_text import TEXT_MATHS
from guardfl.redteam.attacks.registry import register
from guardfl.redteam.client.transmit import TransmitSimulator, flatten_update
from guardfl.redteam.auxdata import random_flips, training_pool
from guardfl.redteam.client.simulate import FedAvg
from guardfl.redteam.threat import ThreatModel, inter_instahide

#: models with more parameters than this are hashed to ``0.5 x`` by default (the paper's ResNet-20 choice)
AUTO_HASH_ABOVE = 100_000

#: the quick budget of a text client (2 CPU cores: transformer3, B=1, L=16, ~1,000-2,000 auxiliary
#: sequences). One draw of the training observations (each costs a 10.7M-coordinate gradient, ~0.1 s per
#: batch on quiet cores, more with pruning: most of the preparation, 155 s for 1,500 windows without a
#: defense); 12 epochs (measured on 1,500 windows of the built-in text, the held-out accuracy is flat
#: after ~10: 0.369 at 12, 0.372 at 30); hash 8,192 (16,384: 0.372 at 30 epochs, twice the training time)
TEXT_QUICK = {"text_hidden": 512, "token_hidden": 128, "text_epochs": 12, "text_batch": 64, "text_lr": 1e-3,
              "text_lr_drop_at": 0.75, "text_refresh_every": 12, "text_hash_dim": 8192}


class LearnedInversionConfig(AttackConfig):
    hidden: int | None = Field(default=None, ge=1, le=100_000, json_schema_extra={"allowed": "null (paper: 3000 for B=1, 10000 for B>1) or an integer in [1, 100000]"})
    epochs: int = Field(default=200, ge=1, le=10_000, json_schema_extra={"allowed": "an integer in [1, 10000]"})
    batch: int = Field(default=256, ge=1, le=65_536, json_schema_extra={"allowed": "an integer in [1, 65536]"})
    lr: float = Field(default=1e-4, gt=0, json_schema_extra={"allowed": "> 0"})
    lr_drop_at: float = Field(default=0.75, gt=0, le=1, json_schema_extra={"allowed": "(0, 1]"})
    refresh_every: int = Field(default=1, ge=1, le=10_000, json_schema_extra={"allowed": "an integer in [1, 10000] (epochs)"})
    hash_ratio: float | None = Field(default=None, gt=0, le=1, json_schema_extra={"allowed": "null (auto) or (0, 1]"})
    hash_dim: int | None = Field(default=None, ge=1, json_schema_extra={
        "allowed": "null (hash_ratio) or an integer >= 1 (absolute; overrides hash_ratio)"})
    standardize: bool = True
    #: images: mirror a random half of the auxiliary training images at every draw of the training set
    #: (not in the paper; fresh draws, and so ``refresh_every``, then apply to every defense)
    flip: bool = False
    holdout: float = Field(default=0.1, ge=0, lt=1, json_schema_extra={"allowed": "[0, 1)"})
    # -- a text client (token ids) reads these instead of hidden / epochs / batch / lr / lr_drop_at /
    #    refresh_every; defaults: the paper's and its public code's text budget (learned_inversion_text)
    text_hidden: int = Field(default=600, ge=1, le=100_000, json_schema_extra={"allowed": "an integer in [1, 100000] (text: first hidden layer)"})
    token_hidden: int = Field(default=1000, ge=1, le=100_000, json_schema_extra={"allowed": "an integer in [1, 100000] (text: per position)"})
    text_epochs: int = Field(default=100, ge=1, le=10_000, json_schema_extra={"allowed": "an integer in [1, 10000]"})
    text_batch: int = Field(default=64, ge=1, le=65_536, json_schema_extra={"allowed": "an integer in [1, 65536]"})
    text_lr: float = Field(default=1e-4, gt=0, json_schema_extra={"allowed": "> 0"})
    text_lr_drop_at: float = Field(default=0.5, gt=0, le=1, json_schema_extra={"allowed": "(0, 1]"})
    text_refresh_every: int = Field(default=1, ge=1, le=10_000, json_schema_extra={"allowed": "an integer in [1, 10000] (epochs)"})
    text_hash_dim: int | None = Field(default=None, ge=1, json_schema_extra={
        "allowed": "null (hash_dim, else hash_ratio, else the paper's 10%) or an integer >= 1"})
    token_rows: bool = True


class Inverter(nn.Module):
    """The paper's MLP: two hidden ReLU layers, a sigmoid output scaled into the input range."""

    def __init__(self, dim_in: int, hidden: int, batch: int, shape: tuple[int, ...], input_range: tuple[float, float]) -> None:
        super().__init__()
        self.batch, self.shape, self.range = batch, tuple(shape), tuple(input_range)
        self.net = nn.Sequential(nn.Linear(dim_in, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, batch * math.prod(shape)))

    def forward(self, features: Tensor) -> Tensor:
        lo, hi = self.range
        out = lo + (hi - lo) * torch.sigmoid(self.net(features))
        return out.view(features.shape[0], self.batch, *self.shape)


def matched_mse(pred: Tensor, target: Tensor) -> Tensor:
    """Eq. 3 of Wu et al.: the MSE under the best permutation of each batch (Hungarian, scipy)."""
    if pred.shape[1] == 1:
        return F.mse_loss(pred, target)
    m, b = pred.shape[:2]
    p, t = pred.reshape(m, b, -1), target.reshape(m, b, -1)
    with torch.no_grad():
        cost = (p[:, :, None] - t[:, None]).pow(2).mean(-1).cpu().numpy()
        perm = torch.stack([torch.as_tensor(linear_sum_assignment(c)[1]) for c in cost]).to(pred.device)
    return F.mse_loss(p, t[torch.arange(m, device=pred.device)[:, None], perm])


def _group(images: Tensor, labels: Tensor, batch: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """Random batches of ``batch`` images: ``(N, batch, ...)``, ``(N, batch)``."""
    order = torch.randperm(len(images), generator=gen)
    n = len(images) // batch
    idx = order[: n * batch].view(n, batch)
    return images[idx], labels[idx]


def simulated_public(defense: DefenseConfig | None, threat: ThreatModel) -> Tensor:
    """The public partners of a simulated Inter-InstaHide client: the client's own public set when the
    attacker holds it (``threat.public_data: known``: the .npz the configuration names, read as the client
    reads it), else the attacker's own in-distribution auxiliary images as stand-ins."""
    inter = inter_instahide(defense) if threat.public_data == "known" else None
    if inter is not None:
        return public_set(inter)
    return threat.aux.images


def hash_size(hash_dim: int | None, hash_ratio: float | None, dim: int) -> tuple[float, int]:
    """(ratio, hashed dimension) of a ``dim``-long update: ``hash_dim`` absolute (overrides ``hash_ratio``),
    else ``hash_ratio``, else 0.5 above ``AUTO_HASH_ABOVE`` coordinates and 1 (no hashing) below."""
    if hash_dim is not None:  # absolute: overrides hash_ratio
        return min(1.0, hash_dim / dim), min(hash_dim, dim)
    ratio = hash_ratio if hash_ratio is not None else (0.5 if dim > AUTO_HASH_ABOVE else 1.0)
    return ratio, max(1, int(dim * ratio))


def _holdout(net: nn.Module, draw: Callable[..., tuple[Tensor, Tensor]], val_idx: Tensor, train_images: Tensor,
             mu: Tensor, sd: Tensor, device: torch.device) -> dict[str, float]:
    """The trained inverter's matched MSE on the held-out batches (``draw(val_idx)``, unflipped), and that
    of the training images' mean image as a baseline."""
    net.eval()
    with torch.no_grad():
        vf, vt = draw(val_idx, augment=False)
        pred = net((vf - mu) / sd)
        out = {"holdout_mse": float(matched_mse(pred, vt))}
        mean_image = train_images.mean(0).to(device)
        out["holdout_mse_mean_image"] = float(F.mse_loss(mean_image.expand_as(vt), vt))
    return out


@register
class LearnedInversion(Attack):
    """Wu et al. 2023 (LTI / LTI-OOD): an MLP trained on defended observations of auxiliary data."""

    name = "learned_inversion"
    Config = LearnedInversionConfig
    capabilities = Capabilities(needs_aux=True, prepares=True, batches_samples=True, modalities=frozenset({"image", "text"}),
                                inverts_encodings=True,
                                threat=frozenset({"labels", "defense", "fedavg"}) | DECODING_THREAT)  # the simulator runs the client's own BN mode
    #: the ``text_*`` / ``token_hidden`` entries budget a text client (token ids), the others an image client
    budgets = {
        "quick": {"hidden": 512, "epochs": 20, "batch": 64, "lr": 1e-3, "refresh_every": 4, "flip": True,
                  **TEXT_QUICK},
        "paper": {"epochs": 200, "batch": 256, "lr": 1e-4, "refresh_every": 1,
                  "text_hidden": 600, "token_hidden": 1000, "text_epochs": 100, "text_batch": 64, "text_lr": 1e-4,
                  "text_lr_drop_at": 0.5, "text_refresh_every": 1, "text_hash_dim": None},
    }
    paper_budget = ("Wu et al. 2023: MLP hidden 3,000 (B=1) / 10,000 (B=4), 200 epochs, minibatch 256, Adam lr 1e-4 "
                    "-> 1e-5 after 150 epochs, 50,000 auxiliary images (5,000 nearly as good, Fig. 3a). Text (Sec. 4.2, "
                    "App.; public code): MLP 600 then 1,000 per position, count-sketch to 10% of the trained "
                    "dimensions, 100 epochs, minibatch 64, Adam lr 1e-4 (the paper picks 1e-3/1e-4/1e-5 per defense) "
                    "-> 1e-5 after 50 epochs, ~180,000 WikiText sequences of 16 tokens")

    @classmethod
    def _refuses(cls, setting: Setting, threat: ThreatModel) -> str | None:
        if isinstance(setting.protocol, FedAvg) and threat.fedavg == "unknown":
            return "needs the FedAvg local hyperparameters to simulate the deltas (threat fedavg='unknown')"
        if setting.modality in TEXT_MATHS:
            return TEXT_MATHS[setting.modality].refusal(setting, threat)
        if tuple(threat.aux.shape) != tuple(setting.input_shape):
            return f"auxiliary images have shape {tuple(threat.aux.shape)}, the client's {tuple(setting.input_shape)}"
        return None

    def preparation_key(self, setting: Setting, threat: ThreatModel) -> str:
        """``Attack.preparation_key`` without ``token_rows``: a reconstruction-time choice (the trained
        inverter is the same either way)."""
        if not self.config.token_rows:
            return type(self)(**{**self.config.model_dump(), "token_rows": True}).preparation_key(setting, threat)
        return super().preparation_key(setting, threat)

    # -- preparation: train the inverter --------------------------------------------------------------
    def _prepare(self, setting: Setting, threat: ThreatModel, device: torch.device, gen: torch.Generator) -> dict[str, Any]:
        """The inverter of the setting's modality (images here; text: ``learned_inversion_text.prepare_text``)."""
        if setting.modality in TEXT_MATHS:
            return TEXT_MATHS[setting.modality].prepare(self.config, self.name, setting, threat, device, gen)
        c = self.config
        t0 = time.time()
        b = setting.num_samples
        images, labels = training_pool(threat.aux, setting.num_classes, gen, setting.input_range)
        val_idx, train_idx = holdout_split(len(images), c.holdout, b, gen, "images")
        defense = setting.defense_config if threat.defense == "known" else None
        # the simulated defense's randomness: the attacker's own stream, from the attack's generator (the
        # client's seed is dropped), so the same run seed gives the same inverter
        sim = TransmitSimulator(setting.model, defense, setting.protocol, train_mode=setting.train_mode, device=device,
                                seed=int(torch.randint(0, 2**62, (1,), generator=gen)),
                                public=simulated_public(defense, threat))
        random_defense = sim.defense is not None and sim.defense.randomized
        # flips redraw a deterministic defense only where a draw is cheap (a vmapped pass); a defense that
        # reads the model per batch (Soteria: ~0.16 s per LeNet batch) keeps its one flipped draw
        redraw = random_defense or (c.flip and not sim.reads_model)
        ratio, out_dim = hash_size(c.hash_dim, c.hash_ratio, sim.dim)
        sketch = CountSketch(sim.dim, out_dim, seed=int(torch.randint(0, 2**62, (1,), generator=gen))) if ratio < 1 else None

        def draw(idx: Tensor, augment: bool = c.flip) -> tuple[Tensor, Tensor]:
            pool = random_flips(images[idx], gen) if augment else images[idx]
            x, y = _group(pool, labels[idx], b, gen)
            return sim.updates(x, y, sketch), x.to(device)

        feats, targets = draw(train_idx)
        mu, sd = standardiser(feats, c.standardize)
        hidden = c.hidden or (3000 if b == 1 else 10000)
        with torch.random.fork_rng(devices=[]):  # init from the attack's generator, the global RNG untouched
            torch.manual_seed(int(torch.randint(0, 2**62, (1,), generator=gen)))
            net = Inverter(feats.shape[1], hidden, b, setting.input_shape, setting.input_range).to(device)
        losses, _ = train_inverter(net, feats, targets, matched_mse, (lambda: draw(train_idx)) if redraw else None,
                                   mu=mu, sd=sd, epochs=c.epochs, batch=c.batch, lr=c.lr, lr_drop_at=c.lr_drop_at,
                                   refresh_every=c.refresh_every, gen=gen, progress=c.progress, name=self.name,
                                   metric="mse")
        in_dist = threat.aux.labels.unique().tolist() if len(threat.aux.labels) else []
        missing = sorted(set(range(setting.num_classes)) - set(in_dist))
        info: dict[str, Any] = {"aux_images": len(images),
                                "aux_classes_missing": missing,  # LTI is weak on labels its in-distribution aux lacks
 "train_batches": int(len(train_idx) // b), "hidden": hidden,
                                "input_dim": sim.dim, "hash_dim": sketch.dim_out if sketch else None,
                                "epochs": c.epochs, "final_train_mse": losses[-1],
                                "defense_augmentation": defense is not None, "fresh_draws": bool(redraw),
                                "flip": c.flip}
        if len(val_idx) >= b:
            info.update(_holdout(net, draw, val_idx, images[train_idx], mu, sd, device))
        info["train_seconds"] = time.time() - t0
        return {"net": {k: v.cpu() for k, v in net.state_dict().items()}, "dims": (feats.shape[1], hidden, b),
                "mu": mu.cpu(), "sd": sd.cpu(), "sketch": sketch.spec() if sketch else None, "info": info}

    def preparation_info(self, state: dict[str, Any]) -> dict[str, Any]:
        return dict(state["info"])

    # -- reconstruction: one forward pass ---------------------------------------------------------------
    def _reconstruct(self, observation, knowledge, device, gen) -> Reconstruction:
        return self._invert([observation], [knowledge], device)[0]

    def _reconstruct_many(self, observations, knowledges, device, gens) -> list[Reconstruction]:
        """One forward of the inverter for all observations (the same hashing and standardisation per
        row); each row is its own call's up to the reduction order of the larger matrix products."""
        if len(observations) == 1:
            return super()._reconstruct_many(observations, knowledges, device, gens)
        observations, knowledges = on_device(observations, knowledges, device)
        return self._invert(observations, knowledges, device)

    def _invert(self, observations, knowledges, device) -> list[Reconstruction]:
        """The inverter's answer for observations of the prepared setting (already on ``device``)."""
        state = self._prepared[1]
        setting = Setting.of(observations[0])
        if setting.modality in TEXT_MATHS:
            return TEXT_MATHS[setting.modality].invert(self.config, state, observations, knowledges, device)
        dim_in, hidden, b = state["dims"]
        net = Inverter(dim_in, hidden, b, setting.input_shape, setting.input_range).to(device)
        net.load_state_dict(state["net"])
        net.eval()
        flat = torch.cat([flatten_update(o.update, setting.param_names).to(device)[None] for o in observations])
        if state["sketch"] is not None:
            flat = CountSketch(**state["sketch"])(flat)
        with torch.no_grad():
            x = net((flat - state["mu"].to(device)) / state["sd"].to(device))
        objective = float(state["info"].get("holdout_mse", state["info"]["final_train_mse"]))
        out = []
        for i, (o, k) in enumerate(zip(observations, knowledges)):
            labels, source = labels_for(o, k)
            if labels.dim() == 2:  # an encoding client's soft labels (what it trained on): the class of most weight
                labels = labels.argmax(1)
            out.append(Reconstruction(x[i], labels, objective, [objective],
                                      {"labels": source, "objective": "the inverter's held-out auxiliary MSE (no private data)"}))
        return out
