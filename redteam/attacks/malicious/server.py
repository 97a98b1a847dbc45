"""Malicious-server attacks: the server sends the client a model of its own making and reads the updates.

The lifecycle differs from an honest server's in one place: instead of ``reconstruct(observation)``, a
``ServerAttack`` gets ``interrogate(client, setting, threat)``, where ``client`` is a ``ClientQuery``: a
callable that takes the model the server sends and returns what the client transmits, computed on its
private batch through the real defense path. The attack crafts the model(s) from the ``Setting`` (the
honest global model, the batch geometry, the defense's configuration), queries as many times as its
method needs (``Reconstruction.info["queries"]``), and returns the reconstruction of the client's batch.
It never sees the batch itself. ``Reconstruction.info["malicious_model"]`` is the (last) model it sent.

``capabilities.server == "malicious"``: ``applicable`` requires ``threat.server: malicious``; under an
honest threat (the default certificate) these attacks are listed as not applicable, with that reason.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Literal

import torch
from pydantic import BeforeValidator, Field

from guardfl.defenses import DefenseConfig, parse_config
from guardfl.redteam.attacks.base import Attack, NotApplicable, Reconstruction
from guardfl.redteam.attacks.compute import exact_float32, resolve_device
from guardfl.redteam.attacks.denoise import CALIBRATION_IMAGES, Calibration, calibration_for, denoise
from guardfl.redteam.attacks.known_defense import known_defense
from guardfl.redteam.attacks.labels import infer_labels
from guardfl.redteam.attacks.setting import Setting
from guardfl.redteam.client.simulate import ClientQuery, ModelRefused, Observation
from guardfl.redteam.threat import ThreatModel, defense_kinds


class ServerAttack(Attack):
    """Base of the attacks that send the client a modified model (see the module docstring)."""

    #: whether the attack's reads come from one round's update (its model may be sent again and averaged):
    #: False for an attack that combines different rounds' updates (differences, bits), which read nothing
    #: of a client whose inputs are encoded afresh every round (``encoded_rounds``)
    one_round_reads: bool = True

    @classmethod
    def applicable(cls, setting: Setting, threat: ThreatModel | None = None) -> str | None:
        reason = super().applicable(setting, threat)
        if reason is None and not cls.one_round_reads and (threat or ThreatModel()).defense == "known" \
                and encodes_inputs(setting.defense_config):
            return ("its reads combine the updates of several rounds, and this client encodes its inputs afresh "
                    "every round (MixUp / InstaHide): the one-round constructions read its encodings instead")
        return reason

    def interrogate(self, client: ClientQuery, setting: Setting, threat: ThreatModel | None = None,
                    seed: int | None = None) -> Reconstruction:
        """Attack one client (its private batch, behind ``client``) by sending it models of the attack's
        own making. ``seed`` (default ``config.seed``, OS entropy when None) seeds the attack's own
        randomness (the crafted model's random parts)."""
        threat = threat or ThreatModel(server="malicious")
        reason = self.applicable(setting, threat)
        if reason is not None:
            raise NotApplicable(f"{self.name}: {reason}")
        device = resolve_device(self.config.device)
        gen = self._generator(self.config.seed if seed is None else seed)
        try:
            with exact_float32():
                rec = self._interrogate(client, setting, threat, device, gen)
            rec = self._filtered(rec, setting, threat)
        except ModelRefused as refused:
            # the client's inspection refused a model: it sent nothing for it, and the attack ends with
            # what it had (nothing: a grey guess) and the reasons on record
            rec = refused_reconstruction(setting, refused.reasons, refused.info)
        rec.info.setdefault("queries", client.queries)
        rec.info.setdefault("refused_queries", getattr(client, "refused", 0))
        rec.info.setdefault("rounds_answered", getattr(client, "answered", client.queries))
        if getattr(client, "budget_refused", 0):
            rec.info.setdefault("refused_by_budget", client.budget_refused)
        return rec

    def _interrogate(self, client: ClientQuery, setting: Setting, threat: ThreatModel, device: torch.device,
                     gen: torch.Generator) -> Reconstruction:
        raise NotImplementedError

    def denoiser(self, setting: Setting, threat: ThreatModel) -> tuple[Calibration | None, str]:
        """The filters this attack puts its reads through (``attacks.denoise``; None: none) and the
        certificate's line on why: an attack with a ``denoise`` option (its reads linear), on images, with
        auxiliary images to calibrate on; ``denoise: auto`` unless the server knows a defense that draws no
        fresh noise (nothing white to filter)."""
        mode = getattr(self.config, "denoise", None)
        if mode is None:
            return None, "no (the attack's reads are not linear)"
        if mode == "off":
            return None, "off (set by denoise)"
        if len(setting.input_shape) != 3:
            return None, "no (not images)"
        if threat.aux is None:
            return None, "no (no auxiliary images to calibrate the filters on)"
        if mode == "auto" and threat.defense == "known" and not fresh_noise(setting.defense_config):
            return None, "off (auto: the defense the server knows draws no fresh noise)"
        calibration = calibration_for(threat.aux.images, threat.aux.digest(), tuple(setting.input_range))
        return calibration, f"calibrated on {min(len(threat.aux.images), CALIBRATION_IMAGES)} auxiliary images"

    def _filtered(self, rec: Reconstruction, setting: Setting, threat: ThreatModel) -> Reconstruction:
        """``rec`` with its images through ``denoiser``'s filters (each read the filter of its estimated
        noise) and ``info["denoised"]`` saying which."""
        calibration, line = self.denoiser(setting, threat)
        if calibration is None:
            if getattr(self.config, "denoise", None) is not None:
                rec.info["denoised"] = line
            return rec
        images, counts = denoise(rec.inputs, calibration, tuple(setting.input_range))
        used = ", ".join(f"{kind}{'' if kind == 'none' else f' {s:g}'}: {n}" for (kind, s), n in counts.items())
        rec.info["denoised"] = f"{used} reads (each read's filter chosen by its estimated noise; {line})"
        return dataclasses.replace(rec, inputs=images)

    def reconstruct_many(self, observations: list[Observation], threat: ThreatModel | None = None,
                         seeds: list[int | None] | None = None) -> list[Reconstruction]:
        raise NotApplicable(f"{self.name}: a malicious-server attack sends the client its own model; an update the "
                            "client computed on the honest model cannot be attacked this way (use interrogate)")



def refused_reconstruction(setting: Setting, reasons: list[str], info: dict | None = None) -> Reconstruction:
    """What an attack gets from a client whose inspection refused the model it was sent (the server's own,
    or the honest one under ``client.inspect_leak_limit``): nothing, so a grey guess of the batch, the
    reasons on record (``info["refused"]``) and ``info`` (the attack's lines on the model it sent)."""
    empty = torch.zeros((0, *setting.input_shape))
    return Reconstruction(fill_batch(empty, setting.num_samples, setting.input_range),
                          torch.zeros(setting.num_samples, dtype=torch.long), float("nan"), [],
                          {**(info or {}), "labels": "not restored", "refused": "; ".join(reasons)})


def server_labels(observation: Observation, setting: Setting, threat: ThreatModel) -> tuple[torch.Tensor, str]:
    """The labels a server attack returns with its images, and where they came from: granted
    (``threat.labels: known``), restored from the classifier's update when the batch has at most one
    sample per class, else zeros marked "not restored" (the attacks that read inputs, not labels)."""
    knowledge = threat.knowledge(observation)
    if knowledge.labels is not None:
        return knowledge.labels, "known"
    if setting.num_samples <= setting.num_classes:
        return infer_labels(observation), "inferred"
    return torch.zeros(setting.num_samples, dtype=torch.long), "not restored"


def fill_batch(images: torch.Tensor, samples: int, input_range: tuple[float, float]) -> torch.Tensor:
    """``samples`` images from an attack's ``k`` reconstructions of part of a batch: repeated in turn
    (mid-grey when there are none). Metrics match reconstructions to private images one to one
    (``metrics.match``: the most exact pairs first, then the least total error); copies keep every
    reconstruction available to each image it might match, where grey placeholders would only add guesses."""
    if images.shape[0] >= samples:
        return images[:samples]
    if images.shape[0] == 0:
        lo, hi = input_range
        return torch.full((samples, *images.shape[1:]), (lo + hi) / 2)
    reps = -(-samples // images.shape[0])
    return images.repeat(reps, *([1] * (images.dim() - 1)))[:samples]


def pruning_stages(config: DefenseConfig | dict | None) -> list[tuple[float, str]]:
    """``(ratio, scope)`` of every stage of the client's defense that zeroes the smallest entries: GradPrune
    (its ``scope``: ``layer`` or ``global``) and Outpost (its ``prune``, per layer); stages that prune nothing
    left out."""
    stages = []
    for leaf in defense_kinds(config):
        if leaf.kind == "gradprune":
            stages.append((float(leaf.ratio), leaf.scope))
        elif leaf.kind == "outpost" and leaf.prune > 0:
            stages.append((float(leaf.prune), "layer"))
    return stages


#: defenses that draw fresh randomness in every round the client answers: a server that sends one model
#: again and averages the updates of the same batch shrinks that noise by the square root of the repeats
FRESH_NOISE = frozenset({"gaussian", "laplace", "outpost", "dpsgd", "graddefense"})
#: the repeats ``repeats: auto`` sends against such a known defense: 16 rounds of one model, the noise a
#: quarter of one round's (a client answers far more rounds than this in a deployment)
AUTO_REPEATS = 16
#: the allowed range of an attack's ``repeats`` (above the leak history's default of 256 rounds a batch)
MAX_REPEATS = 1024


def fresh_noise(config: DefenseConfig | dict | None) -> list[str]:
    """The kinds of ``config``'s stages (as the server knows it; None: none) that draw fresh noise every
    round (``FRESH_NOISE``), sorted: what averaging repeated rounds shrinks."""
    return sorted({leaf.kind for leaf in defense_kinds(config)} & FRESH_NOISE)


def encodes_inputs(config: DefenseConfig | dict | None) -> bool:
    """Whether ``config`` (as the server knows it; None: none) has a stage that encodes the client's inputs
    afresh every round (MixUp, InstaHide: ``known_defense``'s encodings): its rounds are collected and
    demixed (``encoded_rounds``), never averaged."""
    return known_defense(config).encoding is not None


def check_repeats(value):
    """A malicious attack's ``repeats`` (its config's validator): "auto" or an integer in [1, ``MAX_REPEATS``]."""
    if value != "auto" and not (isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_REPEATS):
        raise ValueError(f"expected 'auto' or an integer in [1, {MAX_REPEATS}] (got {value!r})")
    return value


#: an attack's ``repeats`` option (one field type for every attack that has it): the model sent this many
#: times and the updates averaged (``query_averaged``); "auto": ``AUTO_REPEATS`` against a known defense
#: that draws fresh noise, else 1
Repeats = Annotated[Literal["auto"] | int, BeforeValidator(check_repeats),
                    Field(json_schema_extra={"allowed": f"'auto' or an integer in [1, {MAX_REPEATS}]"})]


#: an attack's ``denoise`` option (the attacks that read images linearly from the update, one field type for
#: every attack that has it): its reads through the filters a server calibrates on its auxiliary images
#: (``attacks.denoise``); "auto": unless the server knows a defense that draws no fresh noise; "on"; "off"
#: (the raw reads)
Denoise = Annotated[Literal["auto", "on", "off"], Field(json_schema_extra={"allowed": "'auto', 'on' or 'off'"})]


def defense_known(setting: Setting, threat: ThreatModel) -> DefenseConfig | None:
    """The client's defense configuration as the server knows it (None: none, or unknown to it)."""
    return setting.defense_config if threat.defense == "known" else None


def repeats_for(config: DefenseConfig | dict | None, repeats: Literal["auto"] | int, budget: int | None = None) -> int:
    """How many times the server sends its model: ``repeats`` as given, or for "auto", against a defense
    (``config``, as the server knows it: None when unknown) with a stage in ``FRESH_NOISE``, every round of
    the client's round budget (``budget``: ``client.max_rounds``, the client's configuration the server knows;
    at most ``MAX_REPEATS``), or ``AUTO_REPEATS`` when the client sets none; else 1, and 1 against an input
    encoding (its rounds are collected instead, ``encoded_rounds``)."""
    if repeats != "auto":
        return int(repeats)
    if not fresh_noise(config) or encodes_inputs(config):
        return 1  # no noise to average; or fresh encodings every round, which the rounds would mix (encoded_rounds)
    return AUTO_REPEATS if budget is None else min(int(budget), MAX_REPEATS)


def averaged_defense(config: DefenseConfig | dict | None, rounds: int) -> DefenseConfig | None:
    """What ``rounds`` averaged updates through ``config`` look like, as a defense configuration the server
    can simulate in one draw: Gaussian noise's sigma and Laplace noise's scale divided by ``sqrt(rounds)``
    (exact for Gaussian noise, clipped or not: the clip is the same every round; for Laplace the same
    standard deviation, the average's shape closer to Gaussian). Other stages are kept as they are: Outpost's,
    DP-SGD's and GradDefense's noise is simulated at one round's, so what a server fits to it is a floor."""
    if config is None or rounds <= 1:
        return None if config is None else parse_config(config)
    root = rounds ** 0.5

    def shrink(node):
        if isinstance(node, dict):
            node = {key: shrink(value) for key, value in node.items()}
            if node.get("kind") == "gaussian":
                node["sigma"] = node["sigma"] / root
            elif node.get("kind") == "laplace":
                node["scale"] = node["scale"] / root
            return node
        return [shrink(item) for item in node] if isinstance(node, list) else node

    return parse_config(shrink(parse_config(config).model_dump(mode="json")))


def query_averaged(client: ClientQuery, model: torch.nn.Module, repeats: int) -> tuple[Observation, int]:
    """``client(model)`` ``repeats`` times, the updates averaged (float64 sums), and how many rounds the
    client answered: each answer is the client's next round on the same batch, its defense's randomness
    drawn afresh, so the average keeps the gradient and divides fresh noise's standard deviation by the
    root of the rounds answered. A refusal of the first query raises (nothing was sent); a later one (a
    leak history's round limit) ends the repeats, and the server keeps the rounds it already holds."""
    first = client(model)
    total = {name: value.detach().double().clone() for name, value in first.update.items()}
    answered = 1
    for _ in range(repeats - 1):
        try:
            update = client(model).update
        except ModelRefused:
            break
        answered += 1
        for name in total:
            total[name] += update[name].detach().double()
    if answered == 1:
        return first, 1
    averaged = {name: (value / answered).to(first.update[name].dtype) for name, value in total.items()}
    return dataclasses.replace(first, update=averaged), answered


def repeats_line(repeats: int, config: DefenseConfig | dict | None, answered: int | None = None,
                 budget: int | None = None) -> str:
    """The certificate's line for what ``query_averaged`` did (``answered``: the rounds the client answered
    of the ``repeats`` asked; None: all of them; ``budget``: the client's round budget, ``client.max_rounds``)."""
    answered = repeats if answered is None else answered
    noisy = bool(fresh_noise(config))
    if repeats <= 1 and encodes_inputs(config):
        return "1 (the client encodes its inputs afresh every round: the rounds are collected, not averaged)"
    if repeats <= 1:
        if noisy and budget == 1:
            return "1 (the client answers one round: client.max_rounds is 1)"
        return ("1 (set by repeats; the defense draws fresh noise, which more rounds would average)" if noisy else
                "1 (no fresh noise to average in the defense the server knows)")
    line = (f"{answered} (the same model sent {answered} times, the updates averaged: fresh noise "
            f"{answered ** 0.5:.3g} times smaller)")
    if answered < repeats:
        line += f"; {repeats} asked, the client refused round {answered + 1}"
    return line + ("; the client's whole round budget (client.max_rounds)" if budget is not None and answered >= budget else "")
