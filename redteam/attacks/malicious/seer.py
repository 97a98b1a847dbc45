"""SEER (Garov, Dimitrov, Jovanović, Vechev, "Hiding in Plain Sight: Disguising Data Stealing Attacks in
Federated Learning", ICLR 2024): a malicious server that trains the weights of the client's own
architecture, jointly with a secret decoder, so that the client's aggregate gradient decodes to the one
image of the batch with the most of a secret property (``max`` mode: the brightest, ...). Nothing in the
model is a construction: its weights are trained dense weights, and the gradient is an ordinary sum over
the batch that only the server's decoder separates. It is the literature's answer to client-side checks
(the paper's D-SNR, guardfl's ``inspect_model``), and the red team's learned adaptive server.

Preparation (once per setting, cached): a copy of the honest global model and the decoder are trained on
the attacker's auxiliary images, in batches of the client's size, the model in train mode
(``seer_training.seer_loss``: the chosen sample's gradient decodes to its image, so does the batch's sum,
and two combinations of the others decode to nothing). A held-out fifth of the auxiliary images measures
what was learned: the decoded image's SSIM against the batch's mean image as the guess. **A SEER that does
not beat that guess by ``min_gain`` fails the run** (``AttackFailed``, exit 2): it would bound nothing,
and a certificate resting on it would be the false green this red team exists to prevent.

Interrogation: one query. The model sent is one of ``checkpoints`` kept along the training: against a client
that inspects (its configuration is the server's knowledge), the one that decodes best on the held-out
images among those the client's inspection passes on the server's shadow batches of its own images
(``evade``, ``trap_fit.passes``: with the server's margin); the final one otherwise. The server is adaptive
this way because the learned model is caught: at a batch of 64 it learns to single out samples at
BatchNorm's output, and the isolation check there refuses it. So it also trains against that check
(``spread``: ``seer_training.singling_out`` in the loss), and then every check passes it (docs section 20). The decoder reads the first dense layer's
update; the image stands for the batch (``fill_batch``).

Deviations, stated (docs/research/malicious-server.md section 3 and 20):
- The decoder reads the first dense layer (``seer_training``'s docstring): SEER's reads random coordinates of
  every layer. So this SEER hosts on ``nn.Linear`` on the flattened input, ``nn.BatchNorm1d``, ``nn.ReLU``,
  ``nn.Linear`` (``fc2bn``); convolutional models (SEER's ResNet-18) are not applicable, with the reason.
- ``max`` mode only (the brightest, ... of the batch), which needs BatchNorm on batch statistics: a model
  without it cannot tell one sample of the batch from the others (refused), and so does a client in eval
  mode. SEER's ``thresh`` mode (secure aggregation) is not built.
- Quick budget: 1,500 steps of Adam at 1e-3 on augmented auxiliary images; the paper's: 1000 epochs of 1000
  batches at 1e-4, gradients accumulated over 10 (100,000 steps), on a GPU.
- The model is trained on clean gradients (SEER's paper evaluates no defense). Against a client defense the
  server knows (``threat.defense: known``), the decoder of the model sent is then fitted to that defense
  (``adapt_steps``, ``seer_adapt``: the client's defense simulated on the server's own batches, as
  ``learned_inversion`` trains through it); against noise whose scale does not follow the gradient's
  (Gaussian, Laplace, Outpost) the model sent is rescaled (``boost``: the first layer divided by 10 to 1000,
  its gradient as many times larger, the forward pass the same through BatchNorm while its eps stays small
  beside the rescaled variance; chosen on the server's held-out images; as ``robbing_the_fed``'s boost).
  Both are chosen at the noise the server will face: with ``repeats`` rounds averaged, Gaussian and Laplace
  noise is simulated divided by the root of the rounds (``server.averaged_defense``; since 2026-11-29).
  ``through: true`` makes the joint training itself go through a differentiable stand-in for a known
  pruning (GradPrune, Outpost's), sign compression or clipped noise (the mask of the largest entries; sign
  forward, identity backward; the norm scaled to the clip, then fresh noise); off by default, since it read
  worse than the clean training with a fitted decoder, or no better (clipped noise).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Literal

import torch
from pydantic import Field, field_validator
from torch import nn

from guardfl.defenses import DefenseConfig
from guardfl.redteam.attacks.base import DECODING_THREAT, AttackConfig, AttackFailed, Capabilities, Reconstruction
from guardfl.redteam.attacks.compute import progress_bar
from guardfl.redteam.attacks.dense import trap_layers
from guardfl.redteam.attacks.malicious.seer_adapt import (BOOSTS, NOISE_KINDS, adapt, defended_held_out, rescale,
                                                         surrogate)
from guardfl.redteam.attacks.malicious.seer_training import PROPERTIES, Decoder, augment, held_out, seer_loss
from guardfl.redteam.attacks.malicious.server import (Repeats, ServerAttack, averaged_defense, defense_known, fill_batch,
                                                    query_averaged, repeats_for, repeats_line, server_labels)
from guardfl.redteam.attacks.malicious.trap_fit import passes, shadows
from guardfl.redteam.attacks.registry import register
from guardfl.redteam.attacks.setting import Setting
from guardfl.redteam.client.simulate import ClientQuery, ModelRefused
from guardfl.redteam.client.transmit import TransmitSimulator
from guardfl.redteam.threat import ThreatModel, defense_kinds

#: held-out batches the preparation is measured on
HELD_OUT_DRAWS = 30


class SeerConfig(AttackConfig):
    prop: Literal["bright", "dark", "red", "green", "blue"] = Field(
        default="bright", json_schema_extra={"allowed": "'bright', 'dark', 'red', 'green' or 'blue'"})
    steps: int = Field(default=1500, ge=1, le=1_000_000, json_schema_extra={"allowed": "an integer in [1, 1000000]"})
    lr: float = Field(default=1e-3, gt=0, le=1, json_schema_extra={"allowed": "in (0, 1]"})
    #: the disaggregator's maps (combinations of the first layer's gradient rows)
    width: int = Field(default=8, ge=1, le=256, json_schema_extra={"allowed": "an integer in [1, 256]"})
    #: the share of the auxiliary images held out to measure the training
    holdout: float = Field(default=0.2, gt=0, lt=1, json_schema_extra={"allowed": "in (0, 1)"})
    #: the held-out SSIM the decoded image must beat the batch's mean image by, or the run fails
    min_gain: float = Field(default=0.1, ge=0, le=1, json_schema_extra={"allowed": "in [0, 1]"})
    #: models kept along the training (evenly spaced, the last the final one): against an inspecting client
    #: the server sends the one that decodes best on its held-out images among those the client's inspection
    #: passes on the server's shadow batches (``evade``)
    checkpoints: int = Field(default=8, ge=1, le=64, json_schema_extra={"allowed": "an integer in [1, 64]"})
    #: the weight of ``seer_training.singling_out`` in the loss: the model trained not to single samples out
    #: at BatchNorm's output, where guardfl's isolation check looks (0: SEER's loss alone)
    spread: float = Field(default=10.0, ge=0, le=1000, json_schema_extra={"allowed": "in [0, 1000]"})
    #: against a known defense that prunes, sign-compresses or clips before its noise: the joint training goes through a
    #: differentiable stand-in for it (``seer_adapt.surrogate``), so that the model puts the image where the
    #: defense leaves it (one preparation per such defense). Off by default: measured at a batch of 8 it read
    #: worse through GradPrune 0.99 and sign compression than the model trained on clean gradients with its
    #: decoder fitted to the defense (0.29 and 0.30 against 0.33 and 0.41), better only through GradPrune 0.9
    #: (0.49 against 0.46), pruning at 7x the training time; through Gaussian 0.01 clipped to 1 and 10 it
    #: read 0.17 and 0.46 against 0.18 and 0.47 (docs/research/malicious-server.md section 20)
    through: bool = False
    #: against a known client defense: steps of Adam fitting the decoder of the model sent to the updates the
    #: defense transmits for the server's own batches (``seer_adapt``; 0: the clean decoder reads them)
    adapt_steps: int = Field(default=400, ge=0, le=1_000_000, json_schema_extra={"allowed": "an integer in [0, 1000000]"})
    #: the model sent rescaled so that the first layer's gradient is this many times larger and the forward
    #: pass the same (``seer_adapt.rescale``); "auto": against a known defense whose noise does not follow the
    #: gradient's scale (Gaussian, Laplace, Outpost), the one of ``BOOSTS`` that the client's inspection passes
    #: on the server's shadows and decodes best on its held-out images through the defense, else 1
    boost: Literal["auto"] | float = Field(default="auto", json_schema_extra={"allowed": "'auto' or a number in [1, 10000]"})
    #: the model sent this many times and the updates averaged (``server.query_averaged``); "auto":
    #: ``server.AUTO_REPEATS`` against a known defense that draws fresh noise, else 1. The boost and the
    #: decoder are chosen on one round's noise (the average's is smaller: what they read is a floor)
    repeats: Repeats = "auto"

    @field_validator("boost")
    @classmethod
    def _boost(cls, value):
        if value != "auto" and not (isinstance(value, (int, float)) and not isinstance(value, bool) and 1 <= value <= 1e4):
            raise ValueError("expected 'auto' or a number in [1, 10000]")
        return value


@register
class Seer(ServerAttack):
    """Garov et al. 2024: the client's architecture trained with a secret decoder (see the module docstring)."""

    name = "seer"
    Config = SeerConfig
    capabilities = Capabilities(protocols=frozenset({"fedsgd"}), server="malicious", needs_aux=True, prepares=True,
                                threat=frozenset({"labels", "defense"}) | DECODING_THREAT)  # labels: restored or granted with the image
    budgets = {"quick": {"steps": 1500, "lr": 1e-3, "adapt_steps": 400},
               "paper": {"steps": 100_000, "lr": 1e-4, "adapt_steps": 10_000}}
    paper_budget = "Garov et al. 2024 (SEER train_rel.sh): 1000 epochs x 1000 batches, Adam 1e-4, gradients accumulated over 10"

    def _through(self, setting: Setting, threat: ThreatModel):
        """The stand-in for the client's defense the joint training goes through (``seer_adapt.surrogate``),
        and its name; None when the server does not know the defense, ``through`` is off, or no stage of
        the defense is one the training can follow."""
        known = defense_known(setting, threat)
        return surrogate(known) if self.config.through and known is not None else None

    def preparation_key(self, setting: Setting, threat: ThreatModel) -> str:
        """The joint training reads the defense only where it goes through it: otherwise one preparation
        serves every defense of the same setting (the decoder is fitted to each at interrogation)."""
        if self._through(setting, threat) is None:
            setting = dataclasses.replace(setting, defense_config=None)
        return super().preparation_key(setting, threat)

    @classmethod
    def _refuses(cls, setting: Setting, threat: ThreatModel) -> str | None:
        layers = trap_layers(setting.model, tuple(setting.input_shape))
        if isinstance(layers, str):
            return f"this SEER decodes the first dense layer's gradient: {layers} (SEER's own decoder of a ResNet is a GPU's work: docs/research/malicious-server.md section 3)"
        if not isinstance(layers.norm, nn.modules.batchnorm._BatchNorm):
            return ("SEER's max property (the brightest, ... sample of the batch) is relative to the batch: it needs "
                    "BatchNorm after the first layer, which this model does not have")
        if not setting.train_mode:
            return "SEER's max property needs BatchNorm on the batch's statistics: the client trains in eval mode"
        if f"{layers.first_name}.weight" not in setting.param_names:
            return f"the decoder reads {layers.first_name}.weight, which the client does not send"
        if setting.num_samples < 2:
            return "a batch of one sample needs no disaggregation (the honest-server attacks read it)"
        aux = threat.aux
        if aux is None or not aux.images.is_floating_point() or tuple(aux.images.shape[1:]) != tuple(setting.input_shape):
            return "needs auxiliary images of the client's input shape to train on"
        if len(aux.images) < 5 * setting.num_samples:
            return (f"needs at least {5 * setting.num_samples} auxiliary images (5 batches of the client's "
                    f"{setting.num_samples}: to train on, and to measure the training on held-out images), has {len(aux.images)}")
        return None

    def refuses(self, setting: Setting) -> str | None:
        if self.config.prop in ("red", "green", "blue") and setting.input_shape[0] != 3:
            return f"seer.prop: {self.config.prop!r} needs 3-channel images (these have {setting.input_shape[0]}); use 'bright' or 'dark'"
        return None

    def _prepare(self, setting: Setting, threat: ThreatModel, device: torch.device, gen: torch.Generator) -> dict[str, Any]:
        c, n = self.config, setting.num_samples
        layers = trap_layers(setting.model, tuple(setting.input_shape))
        through = self._through(setting, threat)
        model = copy.deepcopy(setting.model).to(device).train()
        modules = dict(model.named_modules())
        layer, norm = modules[layers.first_name].weight, modules[layers.norm_name]
        images, labels = threat.aux.images, threat.aux.labels
        perm = torch.randperm(len(images), generator=gen)
        held = min(max(n, int(round(c.holdout * len(images)))), len(images) - n)
        test, train = perm[:held], perm[held:]
        decoder = Decoder.init(layer.shape[0], c.width, images[train].mean(0).to(device), gen)
        opt = torch.optim.Adam([*model.parameters(), *decoder.parameters()], lr=c.lr)
        bar = progress_bar(c.progress, c.steps, f"{self.name}: training")
        keep = {round(c.steps * (k + 1) / c.checkpoints) for k in range(c.checkpoints)}
        kept = []
        for step in range(1, c.steps + 1):
            idx = train[torch.randint(len(train), (n,), generator=gen)]
            x = augment(images[idx].to(device), setting.input_range, gen)
            loss = seer_loss(model, layer, decoder, x, labels[idx].to(device), c.prop, gen, norm, c.spread,
                             through[0] if through else None)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if step in keep:
                report = held_out(model, layer, decoder, images[test], labels[test], n, c.prop, setting.input_range,
                                  HELD_OUT_DRAWS, gen)
                kept.append({"step": step, "model": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
                             "decoder": {k: v.cpu() for k, v in decoder.state().items()}, "held_out": report})
            if bar:
                bar.update(1)
        if bar:
            bar.close()
        if not report["ssim"] >= report["ssim_batch_mean"] + c.min_gain:
            raise AttackFailed(
                f"seer: after {c.steps} steps the decoded image's held-out SSIM is {report['ssim']:.3f}, not "
                f"{c.min_gain} past the batch's mean image ({report['ssim_batch_mean']:.3f}): this SEER bounds nothing "
                f"for a batch of {n}, and no certificate may rest on it; raise seer's budget.steps (a GPU: strength paper) "
                "or remove seer from the attacks and say so")
        return {"checkpoints": kept, "layer": layers.first_name, "held_out": report, "train": train, "test": test,
                "through": through[1] if through else "nothing (trained on clean gradients)"}

    def preparation_info(self, state: dict[str, Any]) -> dict[str, Any]:
        return {"layer": state["layer"], "held_out": state["held_out"], "trained_through": state.get("through"),
                "checkpoints": [(k["step"], round(k["held_out"]["ssim"], 3)) for k in state["checkpoints"]]}

    def _interrogate(self, client: ClientQuery, setting: Setting, threat: ThreatModel, device: torch.device,
                     gen: torch.Generator) -> Reconstruction:
        state = self.prepare(setting, threat)
        key = (self._prepared[0], bool(getattr(client, "inspect", False)), bool(getattr(client, "disaggregation", False)),
               getattr(client, "leak_limit", None))
        evasions = self.__dict__.setdefault("_evasions", {})  # the choice reads the client's configuration and the server's data only
        if key not in evasions:
            evasions[key] = evade(state["checkpoints"], client, setting, threat)
        chosen, how = evasions[key]
        repeats = repeats_for(defense_known(setting, threat), self.config.repeats, client.max_rounds)
        # the boost and the decoder are chosen at the noise the server will face: ``repeats`` rounds averaged
        simulated = averaged_defense(defense_known(setting, threat), repeats)
        known = None if simulated is None else simulated.model_dump_json()
        if (key, known) not in evasions:  # the boost reads the defense the server knows
            evasions[key, known] = self._boosted(chosen, client, state, setting, threat, simulated, device, gen)
        sent, k, boosted = evasions[key, known]
        decoder, adapted = self._decoder(chosen, sent, k, state, setting, threat, simulated, device, gen)
        lines = {"property": self.config.prop, "layer": state["layer"], "held_out": chosen["held_out"],
                 "checkpoint": chosen["step"], "evasion": how, "boost": boosted, "defense_adapted": adapted,
                 "malicious_model": sent}
        lines["repeats"] = f"{repeats} asked; the client refused the first round and sent nothing"  # until one is answered
        try:
            observation, answered = query_averaged(client, sent, repeats)
        except ModelRefused as refused:
            refused.info.update(lines)  # the certificate's lines on the model the inspection refused
            raise
        lines["repeats"] = repeats_line(repeats, defense_known(setting, threat), answered, client.max_rounds)
        gradient = observation.update[f"{state['layer']}.weight"].detach().float().cpu()
        lo, hi = setting.input_range
        with torch.no_grad():
            image = decoder(gradient.to(decoder.A.device)).view(*setting.input_shape).clamp(lo, hi).cpu()
        labels, source = server_labels(observation, setting, threat)
        return Reconstruction(fill_batch(image[None], setting.num_samples, setting.input_range), labels.cpu(), 0.0, [],
                              {"labels": source, **lines})

    def _boosted(self, chosen: dict[str, Any], client: ClientQuery, state: dict[str, Any], setting: Setting,
                 threat: ThreatModel, defense: DefenseConfig | None, device: torch.device,
                 gen: torch.Generator) -> tuple[nn.Module, float, str]:
        """The model to send (the checkpoint, rescaled by a boost), the boost, and why. Against a known defense
        (``defense``: as the server simulates it, its rounds averaged; None: none, or unknown) whose noise
        does not follow the gradient's scale, each boost (``BOOSTS``, or the configured one) whose model the
        client's inspection passes on the server's shadows is measured on the server's held-out images through
        the simulated defense (the jointly trained decoder), and the best is sent."""
        sent = copy.deepcopy(setting.model)
        sent.load_state_dict(chosen["model"])
        noisy = sorted({leaf.kind for leaf in defense_kinds(defense)} & NOISE_KINDS)
        c = self.config
        if c.boost == "auto" and not noisy:
            return sent, 1.0, ("none (1): " + ("the client's defense is unknown to the server" if setting.defense_config is not None
                                               and defense is None else "no known defense whose noise ignores the gradient's scale"))
        if c.boost == 1:
            return sent, 1.0, "none (1): boost is 1"
        layers = trap_layers(setting.model, tuple(setting.input_shape))
        copies, what = shadows(client, setting, threat.aux, known=False) if getattr(client, "inspect", False) else ([], "")
        clean, test = Decoder.from_state(chosen["decoder"]).to(device), state["test"]
        tried, best = [], (-2.0, 1.0, sent)
        for k in (BOOSTS if c.boost == "auto" else (float(c.boost),)):  # a configured boost is sent unless refused
            model = sent if k == 1 else rescale(sent, layers.first_name, layers.norm_name, k)
            if k > 1 and any(passes(model, client, setting, x, y) is not None for _, x, y in copies):
                tried.append(f"{k:g}: refused on {what}")
                continue
            sim = TransmitSimulator(model, defense, setting.protocol, train_mode=setting.train_mode, device=device,
                                    seed=int(torch.randint(0, 2**62, (1,), generator=gen)))
            got = defended_held_out(clean, sim, f"{layers.first_name}.weight", threat.aux.images[test],
                                    threat.aux.labels[test], setting.num_samples, c.prop, setting.input_range,
                                    HELD_OUT_DRAWS, gen)["ssim"]
            tried.append(f"{k:g}: held-out SSIM {got:.3f}")
            if got > best[0]:
                best = (got, k, model)
        _, k, model = best
        if k == 1:
            return sent, 1.0, f"none (1): tried {'; '.join(tried)}"
        why = f"against {', '.join(noisy)}" if c.boost == "auto" else "configured"
        return model, k, (f"{k:g} {why} (the first layer divided by it, its gradient {k:g} times larger; tried "
                          f"{'; '.join(tried)})")

    def _decoder(self, chosen: dict[str, Any], sent: nn.Module, k: float, state: dict[str, Any], setting: Setting,
                 threat: ThreatModel, defense: DefenseConfig | None, device: torch.device,
                 gen: torch.Generator) -> tuple[Decoder, dict[str, Any] | str]:
        """The decoder that reads the update of the checkpoint sent: against a known client defense
        (``defense``: as the server simulates it, its rounds averaged), fitted to it (``seer_adapt``, memoised
        per checkpoint, boost and defense) and kept where it reads the
        server's held-out images through the simulated defense better than the jointly trained one (both
        measures in the answer); otherwise the jointly trained one, and why."""
        clean = Decoder.from_state(chosen["decoder"])
        c = self.config
        if defense is None or not c.adapt_steps:
            why = ("no client defense" if setting.defense_config is None else "the defense is unknown to the server"
                   if defense is None else "adapt_steps is 0")
            return clean, f"not adapted: {why} (the jointly trained decoder reads the update)"
        memo = self.__dict__.setdefault("_adapted", {})
        key = (self._prepared[0], chosen["step"], k, defense.model_dump_json())
        if key not in memo:
            sim = TransmitSimulator(sent, defense, setting.protocol, train_mode=setting.train_mode, device=device,
                                    seed=int(torch.randint(0, 2**62, (1,), generator=gen)))
            weight, aux, n = f"{state['layer']}.weight", threat.aux, setting.num_samples
            train, test = state["train"], state["test"]
            probe = int(torch.randint(0, 2**62, (1,), generator=gen))  # the same held-out batches before and after

            def measure(decoder: Decoder) -> dict[str, float]:
                return defended_held_out(decoder, sim, weight, aux.images[test], aux.labels[test], n, c.prop,
                                         setting.input_range, HELD_OUT_DRAWS, torch.Generator().manual_seed(probe))

            before = measure(clean.to(device))
            bar = progress_bar(c.progress, c.adapt_steps, f"{self.name}: fitting the decoder to the defense")
            fitted, losses = adapt(clean.to(device), sim, weight, aux.images[train], aux.labels[train], n, c.prop,
                                   setting.input_range, c.adapt_steps, c.lr, gen, bar=bar)
            if bar:
                bar.close()
            after = measure(fitted)
            # the server keeps the decoder that reads its own held-out images better (never the client's)
            kept = "fitted" if after["ssim"] >= before["ssim"] else "jointly trained (the fitted one read its held-out images worse)"
            memo[key] = (fitted if kept == "fitted" else clean.to(device),
                         {"steps": c.adapt_steps, "held_out_before": before, "held_out_after": after, "kept": kept,
                          "final_loss": losses[-1]})
        return memo[key]


def evade(checkpoints: list[dict[str, Any]], client: ClientQuery, setting: Setting,
          threat: ThreatModel) -> tuple[dict[str, Any], str]:
    """The checkpoint to send and why: against a client that inspects, the one that decodes best on the
    held-out auxiliary images among those its inspection (the client's configuration, which the server
    knows: ``trap_fit.passes``, with the server's margin) passes on every shadow batch of the server's own
    images; the final one when none passes (the client refuses it: nothing sent) or the client does not
    inspect. Nothing of the client's batch is used."""
    final = checkpoints[-1]
    if not getattr(client, "inspect", False):
        return final, "the client does not inspect: the final model"
    copies, what = shadows(client, setting, threat.aux, known=False)
    passing = []
    for k in checkpoints:
        sent = copy.deepcopy(setting.model)
        sent.load_state_dict(k["model"])
        if all(passes(sent, client, setting, x, y) is None for _, x, y in copies):
            passing.append(k)
    if not passing:
        return final, f"no checkpoint passed the inspection on {what}: the final model (step {final['step']})"
    best = max(passing, key=lambda k: k["held_out"]["ssim"])
    return best, (f"{len(passing)} of {len(checkpoints)} checkpoints passed the inspection on {what}; sent step "
                  f"{best['step']} (held-out SSIM {best['held_out']['ssim']:.3f})")
