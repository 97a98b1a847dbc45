"""``trap_weights rows: fit``: the trap sized against the client's own inspection, on the attacker's data.

The isolation check judges how many samples a layer singles out against what the client's architecture
singles out at a fresh initialisation, so the largest trap that passes depends on the data: on a centred
batch the honest model isolates nothing and a trap of 8 chains of 6 rows is refused, on faces in [0, 1] the
honest FC-2 singles out 5-28 of 64 by itself and that trap passes and reads 12 faces exactly
(docs/research/malicious-server.md, section 10). A fixed size is the red team's guess; a server that has read
``guardfl/inspect.py`` measures instead. It knows the client's configuration (its defense, protocol, whether
it inspects and with which checks) and the honest global model the client inspects against, not its batch
or its defense's randomness. So it runs shadows of the client (``shadows``): ``ClientQuery`` on batches of
its auxiliary images as large as the client's (up to ``FIT_BATCHES``, held out from the batch the column
noise is calibrated on, where the auxiliary data has enough; else one, filled up with mirror images), with
the defense's seeds removed (``unseeded``: the shadow draws its own noise; no defense where the threat
keeps the defense unknown). It builds the trap at every size of ``FIT_SIZES`` and the whole layer (and,
without a normalisation, of ``FIT_GROUPED``: cuts of several rows with their own columns), runs
the client's inspection on each shadow batch (``passes``: a model refused there, or whose isolation count
comes within ``FIT_MARGIN`` standard deviations of the limit, reads nothing on that batch), sends the rest to the shadow and counts the images it reads exactly (SSIM >
``EXACT_SSIM`` after one-to-one matching: its own images, which it may compare with; never the client's).
Against a known defense that draws fresh noise, each shadow's update is averaged over the rounds the
client will give (``repeats``, the client's round budget: ``query_averaged``), so sizes are judged at the
noise the server will face. The client gets the very model that read most per batch on average (ties: the
one refused on fewer batches, then more reads past ``READ_SSIM``, then the best single read, then the
higher mean SSIM). Until 2026-11-29 the ties went from exact reads straight to the mean SSIM, judged at
one round's noise: through Gaussian noise 0.01 clipped to 0.1 no size read a face exactly, and the fit sent
the whole layer, which read nothing (best 0.10-0.13 on the client over 16 rounds) where single rows read
0.23-0.37; it now sends single rows (0.38). When no size passes any shadow batch, the client gets the
first small one (a single row), and the certificate's line says none passed.

What it costs the server: per size, one calibration of the column noise (against an inspecting client) and
one inspection and query per shadow batch; nothing of the client's. Where the auxiliary data holds fewer
than two client batches (the 36 LFW faces of the shipped configs) there is one shadow batch, and the margin
is all that stands between a size near the limit and a refusal on the client's batch (which counts as
nothing sent, as it would for the server).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from guardfl.defenses import DefenseConfig, parse_config
from guardfl.inspect import inspect_model
from guardfl.inspect_isolation import isolation_limit, isolation_spread
from guardfl.redteam.attacks.denoise import denoise
from guardfl.redteam.attacks.malicious.evade_columns import calibration_batch
from guardfl.redteam.attacks.malicious.server import query_averaged, repeats_for
from guardfl.redteam.attacks.setting import Setting
from guardfl.redteam.auxdata import AuxData
from guardfl.redteam.client.simulate import ClientQuery, first_batch
from guardfl.redteam.modality.image import metrics
from guardfl.redteam.threat import ThreatModel

#: the sizes ``rows: fit`` tries besides the whole layer, as (chains, rows per chain): single rows (one
#: reads one sample, under any isolation count), one chain of a few rows, few rows that a pruning keeps, and
#: the sizes of docs/research/malicious-server.md section 10
FIT_SIZES = ((1, 1), (2, 1), (4, 1), (8, 1), (16, 1), (1, 4), (1, 8), (4, 2), (2, 6), (4, 6), (6, 6), (8, 6), (8, 8),
             (12, 6), (16, 4))

#: the grouped sizes ``rows: fit`` tries besides (``trap_weights columns``: chains, rows per chain or None for
#: the whole layer, rows per cut), on a layer without a normalisation: the whole layer in one or two chains
#: of 2 to 4 rows per cut, a few small traps of 2 rows per cut
FIT_GROUPED = ((2, None, 2), (2, None, 3), (2, None, 4), (1, None, 2), (2, 6, 2), (4, 4, 2), (8, 3, 2))

#: a read counts as exact at this SSIM (the measure of issue 34's tables)
EXACT_SSIM = 0.9
#: a read counts as recognisable at this SSIM (the default certificate's ``max_ssim``): where noise leaves
#: no size an exact read, the fit counts these next, then the best single read
READ_SSIM = 0.4

#: the server's margin under the isolation limit, in binomial standard deviations of the fresh model's count
#: (the unit of ``guardfl.inspect_isolation.ISOLATION_SPREAD``): a size whose count on a shadow batch comes
#: closer than this to the limit is taken as refused there
FIT_MARGIN = 1.0

#: the most auxiliary batches the shadow runs each size on (a refusal reads nothing): a size near the
#: inspection's limit passes some batches and not others, and the expected reads say so
FIT_BATCHES = 4


class TrapPlan(NamedTuple):
    """What every trap one attack builds against one setting shares: the host layers (``TrapLayers``), the
    auxiliary images (None without), whether the defense's configuration is known, the boost, equal scales
    (against FedAvg) and a known Outpost (the per-sample traps' constants go in the weights)."""

    layers: Any
    aux: Tensor | None
    known: bool
    boost: float
    equal: bool
    outpost: bool


def sizes(cuts: str, chains: int, units: int, grouped: bool = False) -> list[tuple[int, int | None, int | None]]:
    """The (chains, rows, rows per cut) ``rows: fit`` tries on a first layer of ``units``: the whole layer in
    ``chains`` chains (not with ``cuts: middle``, which places a small trap's rows), then ``FIT_SIZES`` that
    fit (with ``cuts: middle`` at least two rows: a bin lies between two cuts), rows per cut None (the
    config's); with ``grouped`` (a layer with no normalisation, ``columns: 1``) then ``FIT_GROUPED``."""
    whole = [] if cuts == "middle" else [(min(chains, units // 2), None, None)]
    plain = [(k, r, None) for k, r in FIT_SIZES if k * r <= units and (cuts == "top" or r >= 2)]
    def fits(k: int, r: int | None, g: int) -> bool:  # two cuts at least; the middle places small traps only
        if r is None:
            return cuts == "top" and units // (k * g) >= 2
        return k * r * g <= units and (cuts == "top" or r >= 2)

    groups = [(k, r, g) for k, r, g in FIT_GROUPED if fits(k, r, g)] if grouped else []
    return whole + plain + groups


def unseeded(config: DefenseConfig | dict | None) -> DefenseConfig | None:
    """The client's defense configuration without its seeds (every stage's): the shadow draws its own
    randomness, as the server has to."""
    if config is None:
        return None

    def strip(value):
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k != "seed"}
        return [strip(v) for v in value] if isinstance(value, list) else value

    return parse_config(strip(parse_config(config).model_dump(mode="json")))


def shadow_data(aux: AuxData | None, n: int) -> tuple[list[AuxData], str]:
    """The shadow's batches of ``n`` auxiliary samples and how they were chosen: up to ``FIT_BATCHES``
    after the ``n`` the column noise is calibrated on where there are ``2 n`` or more; else one, all of them,
    images with their mirror images after them where fewer than ``n`` (a mirrored face is a face: the
    shadow's batch is as large as the client's, since how many samples share a bin depends on it)."""
    if aux is None or not len(aux.images):
        return [], ""
    images, labels = aux.images, aux.labels
    if len(images) >= 2 * n:
        count = min(FIT_BATCHES, len(images) // n - 1)
        return ([AuxData(images[i * n:(i + 1) * n], labels[i * n:(i + 1) * n]) for i in range(1, count + 1)],
                ", held out from the calibration")
    if len(images) < n and images.is_floating_point() and images.dim() >= 3:
        mirrored = min(n - len(images), len(images))
        return ([AuxData(torch.cat([images, images[:mirrored].flip(-1)]), torch.cat([labels, labels[:mirrored]]))],
                f", {mirrored} of them mirrored")
    return [AuxData(images[:n], labels[:n])], ""


def building_aux(images: Tensor | None, n: int) -> Tensor | None:
    """The auxiliary images the fit builds its traps on (cut-offs, disguise): all but the shadow's held-out
    batches (``shadow_data``), so that a shadow batch is as new to the trap as the client's. Built on all of
    them, a disguise's part that the auxiliary images barely see is orthogonal to every shadow image (on
    images with no common structure, uniform noise, the auxiliary images' principal directions are their
    own span): the shadow read 23-28 of 32 exactly with 2 rows per cut, the client 3. Where the shadow's
    batch is the auxiliary data itself (fewer than ``2 n`` images) there is nothing to hold out."""
    if images is None or len(images) < 2 * n:
        return images
    count = min(FIT_BATCHES, len(images) // n - 1)
    return torch.cat([images[:n], images[(count + 1) * n:]])


def shadows(client: ClientQuery, setting: Setting, aux: AuxData | None,
            known: bool) -> tuple[list[tuple[ClientQuery, Tensor, Tensor]], str]:
    """The server's copies of ``client``, one per batch of its own (``shadow_data``; one of uniform noise
    without auxiliary data, ``calibration_batch``), each with its batch, and what they are, in words. A copy
    runs the client's defense where the threat makes it ``known`` (unseeded), none otherwise, and does not
    inspect: ``passes`` runs the client's inspection, with the server's margin."""
    data, how = shadow_data(aux, setting.num_samples)
    defense = unseeded(client.defense_config) if known else None
    out, what = [], ""
    for part in data or [None]:
        x, y, what = calibration_batch(part, setting)
        out.append((ClientQuery(x, y, defense, client.protocol, input_range=client.input_range,
                                train_mode=client.train_mode), x, y))
    return out, ((f"{len(out)} batches of " if len(out) > 1 else "") + what + how
                 + ("" if known or client.defense_config is None else ", the client's defense unknown: none run"))


def passes(sent: nn.Module, client: ClientQuery, setting: Setting, x: Tensor, y: Tensor) -> str | None:
    """None when ``client``'s inspection (none where it does not inspect) passes ``sent`` on the shadow's
    batch ``(x, y)`` with the server's margin, else why not: ``refused``, or ``near`` when some layer
    isolates more than ``FIT_MARGIN`` binomial standard deviations under its isolation limit, or the
    samples read are within that of the client's leak limit (the client's batch is not the shadow's, and
    a count near the limit there is one over it on some batches)."""
    if not getattr(client, "inspect", False):
        return None
    x, y = first_batch(client.protocol, x, y)  # what the client inspects: its first local step's batch
    limit = getattr(client, "leak_limit", None)
    inspection = inspect_model(sent, setting.model, batch=(x, y), disaggregation=bool(getattr(client, "disaggregation", False)),
                               leak_limit=limit)
    if not inspection.ok:
        return "refused"
    isolation, n = inspection.checks.get("isolation") or {}, len(x)
    if limit is not None:
        read = len(isolation.get("samples_read", []))
        if read + FIT_MARGIN * isolation_spread(n, read) > limit:
            return "near"
    for name, layer in (isolation.get("layers") or {}).items():
        if not layer.get("judged", True):
            continue
        for count, key in (("isolated", "baseline"), ("by_pairs", "baseline_by_pairs")):  # the check's two judgements
            baseline = (isolation.get(key) or {}).get(name)
            if baseline is not None and layer.get(count, 0) > isolation_limit(n, baseline) - FIT_MARGIN * isolation_spread(n, baseline):
                return "near"
    return None


class Read(NamedTuple):
    """What one shadow batch's reconstruction reads of the shadow's own images (one-to-one matching)."""

    exact: int          # past ``EXACT_SSIM``
    recognisable: int   # past ``READ_SSIM``
    best: float         # the best single SSIM
    mean: float         # the mean SSIM


NOTHING = Read(0, 0, 0.0, 0.0)


def score(images: Tensor, truth: Tensor, input_range: tuple[float, float]) -> Read:
    """How well the reconstruction ``images`` reads ``truth`` (one-to-one matching): the images past
    ``EXACT_SSIM`` and past ``READ_SSIM``, the best SSIM and the mean."""
    perm = metrics.match(images, truth, data_range=input_range, exact_ssim=EXACT_SSIM)
    span = float(input_range[1] - input_range[0])
    values = [metrics.ssim(images[int(perm[i])], truth[i], span) for i in range(len(truth))]
    return Read(sum(v > EXACT_SSIM for v in values), sum(v > READ_SSIM for v in values), max(values, default=0.0),
                sum(values) / max(1, len(values)))


def fit(attack, plan: TrapPlan, client: ClientQuery, setting: Setting, threat: ThreatModel,
        gen: torch.Generator) -> tuple[Any, int | None, dict]:
    """The trap of the size that reads most of the shadows' batches (see the module docstring), its rows per
    chain (None: the whole layer) and its lines for the certificate (``attack.build``'s, ``rows`` saying
    what was tried)."""
    copies, what = shadows(client, setting, threat.aux, plan.known)
    plan = plan._replace(aux=building_aux(plan.aux, setting.num_samples))
    # the shadows get the rounds the client will: the same model sent again against fresh noise, averaged
    repeats = repeats_for(copies[0][0].defense_config, attack.config.repeats, client.max_rounds) if plan.known else 1
    tried, best, first_small = [], None, None
    calibration, _ = attack.denoiser(setting, threat)  # the reads judged as the client's will be: filtered
    grouped = plan.layers.norm is None and attack.config.columns == 1
    for chains, rows, per_cut in sizes(attack.config.cuts, attack.config.chains, plan.layers.first.out_features, grouped):
        trap, lines = attack.build(plan, chains, rows, client, setting, threat, gen, per_cut)
        first_small = first_small or (None if rows is None else (trap, rows, lines))
        reads, kept = [], {"refused": 0, "near": 0}
        for query, x, y in copies:
            why = passes(trap.sent, client, setting, x, y)
            if why is not None:
                kept[why] += 1
                reads.append(NOTHING)
                continue
            observation, _ = query_averaged(query, trap.sent, repeats)
            images, found = attack.read(observation, trap, plan, setting, rows is not None)
            images, _ = attack.peeled(images, found, observation, y, "known")  # its own labels, as it reads the client's
            if calibration is not None:
                images, _ = denoise(images, calibration, setting.input_range)
            reads.append(score(images, x, setting.input_range))
        label, out = f"{chains} x {rows or 'all'}" + (f" x {per_cut} per cut" if per_cut else ""), kept["refused"] + kept["near"]
        # exact reads, then fewer refused, then recognisable reads and the best read (where noise leaves no
        # size an exact read: the whole layer reads nothing through noise that single rows read through), then
        # mean SSIM to two places (finer digits move with package versions), then more rows: shadows that
        # saturate cannot tell sizes apart, and more rows per sample leave more margin on a batch the shadows
        # did not see. The fit is the same on every machine.
        total = (rows or plan.layers.first.out_features) * chains * (per_cut or 1)
        nb = len(reads)
        mean = (sum(r.exact for r in reads) / nb, -out, sum(r.recognisable for r in reads) / nb,
                round(sum(r.best for r in reads) / nb, 2), round(sum(r.mean for r in reads) / nb, 2), total)
        tried.append(label + (f" {mean[0]:.3g}/{mean[2]:.3g}" if out < len(reads) else "") + "".join(
            f" ({why} {k}{'' if k == len(reads) else f' of {len(reads)}'})" for why, k in kept.items() if k))
        if out < len(reads) and (best is None or mean > best[0]):
            best = (mean, trap, rows, lines, label)
    if best is None:
        trap, rows, lines = first_small
        verdict = "none passed the shadow's inspection with the margin, sent the first small trap"
    else:
        (exact, _, seen, top, *_), trap, rows, lines, label = best
        verdict = (f"{label}, {exact:.3g} exact and {seen:.3g} past SSIM {READ_SSIM} per batch of {setting.num_samples}, "
                   f"best {top:.2f}")
    rounds = f", each shadow's update averaged over {repeats} rounds as the client's will be" if repeats > 1 else ""
    lines["rows"] = f"{rows or 'all'} (fit on {what}{rounds}: {verdict}; chains x rows, exact / recognisable reads: {', '.join(tried)})"
    return trap, rows, lines
