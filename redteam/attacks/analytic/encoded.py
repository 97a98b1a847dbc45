"""Attacking a client that encodes its inputs (MixUp / InstaHide): the two steps of Huang et al. 2021, Sec. 4.

1. ``attack_view``: what a gradient attack reconstructs is what the client trained on, the ENCODED
   images, with the soft labels (granted under ``labels: known``). The view of the observation the attacks
   get has the encodings' value range (InstaHide flips signs: [-m, m]) and, for FedAvg, one row per
   encoding the client trained on: an encoding is drawn afresh for every local step, so E epochs over n
   samples are E*n distinct training inputs (Huang et al.'s "eavesdrop T epochs"), replayed as one pass
   in step order (exact when the batch size divides n and there is no Poisson sampling).
2. ``decode``: the reconstructed encodings are demixed into estimates of the n private images
   (``demix``, blind: k and the coefficient bound are known, never the partners or coefficients), and
   metrics always compare those estimates with the PRIVATE images.

Only an attacker who knows the defense's configuration does this (``threat.defense == 'known'``); one
who does not attacks the update as if the inputs were plain images. Inter-InstaHide mixes each private
image with k-1 public images: an attacker who holds that public set (``threat.public_data == 'known'``;
it is the set the defense's configuration names, ``public_set``) identifies and subtracts each
encoding's public partners and combines the encodings of one private image (``demix_public``); one who
does not decodes them as |encoding| only. Either way the result's info says which.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from guardfl.defenses import DefenseConfig
from guardfl.redteam.attacks.base import Reconstruction
from guardfl.redteam.attacks.analytic.demix import demix
from guardfl.redteam.attacks.analytic.demix_public import decode_public
from guardfl.redteam.attacks.known_defense import known_defense
from guardfl.redteam.client.simulate import FedAvg, Observation


def encoding_of(observation: Observation, defense_known: bool) -> DefenseConfig | None:
    """The input encoding's configuration when the attacker knows it, else None."""
    return known_defense(observation.defense_config).encoding if defense_known else None


def public_set(encoding: DefenseConfig) -> Tensor:
    """The public images of an Inter-InstaHide configuration (its ``public`` .npz, read as the client reads
    it); ``ConfigError`` naming ``instahide.public`` when the configuration names none (a public set given
    to the defense as a tensor: pass it to ``decode`` yourself)."""
    from guardfl.defenses.encoding import load_public
    from guardfl.errors import ConfigError

    if not getattr(encoding, "public", None):
        raise ConfigError("instahide.public: the configuration names no public .npz (the set was given as a tensor), "
                          "so threat.public_data: 'known' has no public set to read; pass public= to decode")
    return load_public(encoding.public)


def encoded_range(encoding: DefenseConfig, input_range: tuple[float, float]) -> tuple[float, float]:
    if encoding.kind == "instahide":
        m = max(abs(input_range[0]), abs(input_range[1]))
        return (-m, m)
    return tuple(input_range)


def attack_view(observation: Observation, defense_known: bool) -> Observation:
    """The observation as a gradient attack on the encoded inputs sees it (unchanged without a known
    encoding)."""
    enc = encoding_of(observation, defense_known)
    if enc is None:
        return observation
    protocol, rows = observation.protocol, observation.num_samples
    if isinstance(protocol, FedAvg) and protocol.epochs > 1:
        rows = protocol.epochs * observation.num_samples
        protocol = dataclasses.replace(protocol, epochs=1)
    return dataclasses.replace(observation, protocol=protocol, num_samples=rows,
                               input_range=encoded_range(enc, observation.input_range))


def _labels(rec_labels: Tensor, weights: Tensor, num_classes: int) -> Tensor:
    """Each demixed image's label: the class with the most mixing weight over the encodings that hold it."""
    soft = rec_labels.float() if rec_labels.dim() == 2 else torch.nn.functional.one_hot(rec_labels.long(), num_classes).float()
    return (weights.T.to(soft) @ soft).argmax(1)


def decode(rec: Reconstruction, observation: Observation, defense_known: bool, *, iterations: int = 200,
           public: Tensor | None = None) -> tuple[Reconstruction, Tensor | None]:
    """Private-image estimates from reconstructed encodings, and the encodings themselves (None, and
    ``rec`` unchanged, without a known encoding). ``public``: the public set the attacker holds
    (``threat.public_data: known``), used for an Inter-InstaHide client only."""
    enc = encoding_of(observation, defense_known)
    if enc is None:
        return rec, None
    n, shape = observation.num_samples, observation.input_shape
    y = rec.inputs.detach().float().cpu().flatten(1)
    if enc.kind == "instahide":
        y = y.abs()
    lo, hi = observation.input_range
    info = dict(rec.info)
    inter = enc.kind == "instahide" and enc.mode == "inter"
    if inter and public is not None:
        found, weights, stats = decode_public(y.reshape(-1, *shape), public.detach().float().cpu(), n, int(enc.k),
                                              float(enc.max_coeff), (lo, hi))
        x = found.flatten(1)
        info.update(decode=f"public partners identified in the known public set ({public.shape[0]} images) and "
                           f"subtracted, {y.shape[0]} encodings combined into {n} images",
                    demix_residual=stats["residual"], private_weight=stats["private_weight"])
    elif inter:
        x = y[:n].clamp(lo, hi)
        weights = torch.eye(y.shape[0], n)
        info["decode"] = "|encoding| (inter-InstaHide, public set unknown: public partners are not demixed)"
    else:
        x, weights, residual = demix(y, n, int(enc.k), float(enc.max_coeff), (lo, hi), iterations=iterations)
        info.update(decode=f"blind demixing of {y.shape[0]} encodings into {n} images", demix_residual=residual)
    labels = _labels(rec.labels.cpu(), weights, observation.num_classes)
    decoded = Reconstruction(x.reshape(n, *shape), labels, rec.objective, rec.restart_objectives, info)
    return decoded, rec.inputs.detach().cpu()
