"""A malicious server against a client that encodes its inputs (MixUp, InstaHide), as a server that knows
the encoding attacks it.

What a construction reads from such a client's update is what the client trained on: its encodings, mixes
of k private images (InstaHide: with random signs), drawn afresh every round. Read raw, an encoding passes
no threshold against any one private image, so a server that compared its raw reads would report nothing
where it holds most of the batch, mixed. The server that knows the encoding (``threat.defense: known``):

1. designs its models on its own images encoded the same way (``encoded_aux``: the known configuration,
   the server's own randomness, never the client's): its measurements, cut-offs and bins are those of
   encodings;
2. reads in the encodings' range (InstaHide's signs: ``[-m, m]``; ``encoded.attack_view``);
3. sends its model for ``rounds`` rounds (``rounds_for``: 16, or the client's whole round budget), each a
   fresh set of encodings of the same private batch, and keeps every round's distinct reads
   (``collect``): Carlini et al. 2020 broke InstaHide from many encodings per image, and a server that reads
   encodings exactly gets 50 or so per round;
4. demixes them all into the batch as an honest attack's reconstructed encodings are (``encoded.decode``,
   in the runner): each private image sits in many encodings, which cluster around it.

An attack whose reads combine the updates of several rounds (differences of thresholds, bits of which
units fired) reads nothing meaningful when every round's inputs differ: ``ServerAttack.one_round_reads``
is False for those, and they are not applicable against a known encoding, with that reason.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from guardfl.defenses import DefenseConfig, from_config
from guardfl.redteam.attacks.base import Reconstruction
from guardfl.redteam.attacks.malicious.server import MAX_REPEATS, ServerAttack, fill_batch
from guardfl.redteam.attacks.setting import Setting
from guardfl.redteam.auxdata import AuxData
from guardfl.redteam.client.simulate import ClientQuery
from guardfl.redteam.modality.image.metrics import first_copies
from guardfl.redteam.threat import ThreatModel

#: rounds a server collects from an encoding client that sets no round budget (as ``AUTO_REPEATS``: a client
#: answers far more in a deployment)
ENCODED_ROUNDS = 16


def rounds_for(budget: int | None) -> int:
    """Rounds of reads to collect: ``ENCODED_ROUNDS``, or the client's whole round budget (``client.max_rounds``,
    which the server knows; at most ``MAX_REPEATS``). Collecting stops at the client's first refusal."""
    return ENCODED_ROUNDS if budget is None else min(int(budget), MAX_REPEATS)


def encoded_aux(aux: AuxData | None, encoding: DefenseConfig, num_classes: int, seed: int) -> AuxData | None:
    """The server's auxiliary images through the known encoding, with the server's own randomness (``seed``)
    and the dominant class of each mix as its label; None without auxiliary images."""
    if aux is None or not len(aux.images):
        return aux
    coder = from_config(encoding.model_copy(update={"seed": seed}))
    images, soft = coder.encode(aux.images, aux.labels, num_classes)
    return AuxData(images, soft.argmax(1), aux.ood, aux.ood_samples, f"{aux.name} (encoded: {encoding.kind})")


def distinct_reads(images: Tensor) -> Tensor:
    """The distinct reads of one reconstruction (``fill_batch`` copies and the grey placeholder dropped)."""
    flat = images.flatten(1)
    firsts = sorted(set(first_copies(images)))
    keep = [j for j in firsts if float(flat[j].std()) > 0]
    return images[keep]


def collect(attack: ServerAttack, client: ClientQuery, setting: Setting, threat: ThreatModel, seed: int | None,
            rounds: int) -> Reconstruction:
    """``attack`` against ``client`` for up to ``rounds`` rounds (each a fresh set of encodings of the batch),
    every round's distinct reads in one reconstruction of as many rows, for ``encoded.decode`` to demix.
    A refusal of the first round is the attack's refused reconstruction as it is; a later one ends the
    collection with the rounds read."""
    reads, first, done = [], None, 0
    for _ in range(rounds):
        rec = attack.interrogate(client, setting, threat, seed)
        if rec.info.get("refused"):
            if first is None:
                return rec
            break
        first, done = first or rec, done + 1
        reads.append(distinct_reads(rec.inputs.detach().cpu()))
    found = torch.cat(reads)
    if not len(found):  # no read in any round: the grey guess of the first
        return first
    if len(found) < setting.num_samples:  # fewer encodings than images: repeated, as every attack's reads are
        found = fill_batch(found, setting.num_samples, setting.input_range)
    info = {**first.info, "labels": "not restored (the reads are encodings)", "queries": client.queries,
            "rounds_answered": getattr(client, "answered", client.queries),
            "encoded_rounds": f"{len(found)} encodings read over {done} rounds of fresh encodings of the batch"
                              + (f" ({rounds} asked; the client refused round {done + 1})" if done < rounds else "")}
    return dataclasses.replace(first, inputs=found, labels=torch.zeros(len(found), dtype=torch.long), info=info)
