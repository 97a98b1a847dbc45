"""Threshold bins: the honest first layer made affine on the batch, the batch binned by the classifier over
queries (ours, 2026-11-28; adaptive to ``inspect_model``'s support-based isolation count and leak limit).

Every isolation test in ``guardfl.inspect`` (the pairs, the groups, the leak limit's count) reads which samples
*fire* a unit: a unit that fires for one sample, or a pair of units whose supports differ by one, reads it.
This construction gives no unit such a support. The server keeps the honest first layer's weights and
raises each unit's bias until it fires for every auxiliary image (the lowest pre-activation plus three
standard deviations), so on the client's batch every unit fires for every sample: the first layer is an
affine map ``h = W x + b`` and its update is ``sum_n g_n x_n^T`` with ``g_n = W2^T delta_n``, no sample
alone anywhere. In a deeper MLP every hidden layer is lifted in turn, on the lifted units before it (the
whole stack affine on the batch, ``g_n`` the chain's transposed weights times ``delta_n``; 2026-11-28: until
then a deeper MLP was "not applicable" and a leak-limit certificate rested on the traps alone). Then the
classifier does the binning of the last hidden units, across queries of the same batch (FedSGD on a batch
the client sends each round, the threat fishing's feature search already assumes):

* the classifier is the honest one times ``gain`` (rows of comparable norm: no zeroed row, the honest
  biases: no bias gap), and the target row (class 0) gets ``slope * (a - t c)``: ``a`` a random unit
  direction of the hidden units, ``c = b / |b|^2`` (so ``<c, h> ~ 1`` for every sample: the threshold ``t``
  lives in the weights, never in a bias);
* a sample's target probability switches from ~0 to ~1 where ``t`` passes its switch point
  ``(logit_0 without t - logsumexp of the other logits) / (slope <c, h>)``: a step of width ``1/slope``;
* query ``k`` sends threshold ``t_k`` (the auxiliary switch points' quantiles, ``queries - 1`` bins of equal
  auxiliary mass); in two consecutive queries only the samples whose switch point lies between the two
  thresholds change their ``delta_n``, so the difference of the two updates of the first layer holds those
  samples alone, and with one of them unit ``j``'s weight difference over its bias difference is ``x_n``
  exactly, whatever the coefficients.

Every bin's reading is returned (one per bin; ``queries - 1`` defaults to the batch size), single-sample
or not: the attacker cannot tell them apart reliably here (the units' readings of a two-sample bin can
agree closely when one sample's coefficients dominate, and the float32 difference of two updates blurs a
single one's), and the certificate's one-to-one matching counts each reading once.

Not applicable: a model that is not ``nn.Linear -> nn.ReLU -> ... -> nn.Linear`` (the classifier) with the
first layer on the whole flattened input (a convolution, a normalisation, which couples the units or the
batch, or an activation written as a function rather than a module, which the probe cannot see), FedAvg
(the bins are differences of single gradients), no auxiliary data. Adapted to a pruning (``read_bin``: an
entry zero in either update is no reading; GradPrune 0.9 on 32 faces: 9-11 exact, 3-6 before). Adapted
to noise by averaging only: fresh noise in each query lands in the differences, so each threshold's model is
sent ``repeats`` times and its updates averaged (``query_averaged``; "auto": 16 rounds against a known
defense that draws fresh noise, or the client's round budget shared by the thresholds; 2026-11-29); noise
repeated in every query would cancel there: a client must not reuse a seed across rounds;
docs/research/malicious-server.md section 17). Adapted to a client
that limits what differences of its updates read (``inspect_model(..., history=)``): a refused threshold is
skipped and the next one sent, so the accepted thresholds make wider bins (of two or more samples, which the
client's count reads nothing from), each still read as one image (partial reads, measured by the
certificate). And read exactly past that history (``directions: 4, spread: 3, slope: 20000``): the other
classes' rows spread (``runner_up_rows``: the class a sample leaves varies, so a bin's samples have
coefficients of their own on every unit, within the row test's factor of 4 at the steep slope), bins along
several directions, and two bins of different directions that share one sample meet in it
(``bin_lines``): four updates combined (25 of 64 LFW faces exactly through a limit of 0 with a history of
pairs; docs/research/malicious-server.md section 18), and a line two bins share meets a third bin (six updates), the
answer to a history that meets its views (``guardfl.inspect_meets``), which refuses every round whose bin
would meet another in a face: none exactly since (section 19).
"""

from __future__ import annotations

import copy

import torch
from pydantic import Field
from torch import Tensor, nn

from guardfl.redteam.attacks.base import AttackConfig, Capabilities, Reconstruction
from guardfl.redteam.attacks.dense import run_order, trap_layers
from guardfl.redteam.attacks.malicious.bin_lines import bin_hull, box_ends, crossings
from guardfl.redteam.attacks.malicious.fishing import classifier
from guardfl.redteam.attacks.malicious.server import (Denoise, Repeats, ServerAttack, defense_known, fill_batch, query_averaged,
                                                    repeats_for, repeats_line, server_labels)
from guardfl.redteam.attacks.registry import register
from guardfl.redteam.attacks.setting import Setting
from guardfl.redteam.client.simulate import ClientQuery, ModelRefused
from guardfl.redteam.threat import ThreatModel

#: the bias lift: the lowest auxiliary pre-activation of a unit is raised by this many standard deviations
LIFT_STDS = 3.0
#: the same for the hidden layers after the first: their inputs are lifted units, whose spread on the
#: client's batch strays further from the auxiliary images' (at 3, one face of 32 left a unit of a third
#: hidden layer silent, which the leak limit read and refused; at 6 every model of 1-4 hidden layers of
#: 256 passes it: 12, 12, 7, 5 of 32 LFW faces exactly; a lift of 6 on the first layer too reads 9, not 12)
DEEP_LIFT_STDS = 6.0


class ThresholdBinsConfig(AttackConfig):
    #: models sent (thresholds): ``queries - 1`` bins; None: one bin per sample of the batch (+1)
    queries: int | None = Field(default=None, ge=3, le=1000, json_schema_extra={"allowed": "null or an integer in [3, 1000]"})
    #: the honest classifier's scale (its rows keep comparable norms, none zeroed)
    gain: float = Field(default=1000.0, gt=0, le=1e6, json_schema_extra={"allowed": "a number in (0, 1e6]"})
    #: the target logit's slope along the projection (its step is 1/slope wide)
    slope: float = Field(default=2000.0, gt=0, le=1e7, json_schema_extra={"allowed": "a number in (0, 1e7]"})
    #: the share of each hidden layer's units lifted (a random subset); the others get their threshold at
    #: the median of their auxiliary pre-activations (they fire for about half the batch, as a centred benign
    #: layer's units do). 1: every unit fires for every sample (an affine layer); 0.3: as many always-on
    #: units as a benign layer on inputs in [0, 1] has (up to 32% measured), so no count of them tells
    lifted: float = Field(default=1.0, ge=0.0, le=1.0, json_schema_extra={"allowed": "a number in [0, 1]"})
    #: independent projections the batch is binned along, one sweep of ``queries`` thresholds each; with 2 or
    #: more, every bin of one direction is met with every bin of another (``bin_lines``: two bins sharing one
    #: sample meet in it exactly), the answer to a client that limits each difference of its updates
    directions: int = Field(default=1, ge=1, le=4, json_schema_extra={"allowed": "an integer in [1, 4]"})
    #: the other classes' rows each get a projection of the hidden units, ``spread`` times the honest logits'
    #: spread: the class a sample leaves when it switches varies over the batch, so a bin's samples have
    #: coefficients of their own on every unit and its rows span their hull (0: the honest rows times gain)
    spread: float = Field(default=0.0, ge=0.0, le=1000.0, json_schema_extra={"allowed": "a number in [0, 1000]"})
    #: a bin whose hull is a line (two samples) is read at the line's two ends inside the input range too
    #: (``bin_lines.box_ends``: a sample with a pixel at the range's edge is an end), ahead of the bins' own
    #: reads: a prior, past a client that counts exact reads of its updates only (64 LFW faces, four
    #: directions, against the history's meets: 1 face exactly, none without; the ends take slots the
    #: bins' partial reads had: 49 past SSIM 0.4 against 55)
    box_ends: bool = False
    denoise: Denoise = "auto"  # the filter of its reads (``server.Denoise``)
    #: rounds of each threshold's model, averaged (``server.query_averaged``); "auto": against a known defense
    #: that draws fresh noise, ``AUTO_REPEATS``, or the client's round budget shared by every query
    repeats: Repeats = "auto"


def lifted(layer: nn.Linear, inputs: Tensor, stds: float = LIFT_STDS) -> Tensor:
    """A hidden layer's biases raised so that every unit fires on every auxiliary input (``inputs``: the
    images, or the lifted layer before's units on them), with a margin of ``stds`` standard deviations of
    its pre-activation (units that already do keep theirs plus it)."""
    pre = inputs.flatten(1).double() @ layer.weight.detach().double().T + layer.bias.detach().double()
    return layer.bias.detach().double() + (-pre.min(0).values).clamp(min=0) + stds * pre.std(0)


def lifted_chain(hidden: list[nn.Linear], aux: Tensor, share: float = 1.0,
                 gen: torch.Generator | None = None) -> tuple[list[Tensor], Tensor]:
    """Every hidden layer's biases set in turn on the auxiliary images (each on the units before it), and
    the last hidden layer's units on the images: a random ``share`` of each layer's units lifted (they fire
    for every image; all of them: the whole stack affine on the images), the others with their threshold
    at the median of their auxiliary pre-activations (they fire for about half)."""
    biases, h = [], aux.flatten(1).double()
    for i, layer in enumerate(hidden):
        bias = lifted(layer, h, LIFT_STDS if i == 0 else DEEP_LIFT_STDS)
        if share < 1:
            rest = torch.rand(layer.out_features, generator=gen, dtype=torch.float64) >= share
            bias[rest] = -(h @ layer.weight.detach().double()[rest].T).median(0).values
        biases.append(bias)
        h = (h @ layer.weight.detach().double().T + bias).clamp(min=0)
    return biases, h


def relu_chain(model: nn.Module, input_shape: tuple[int, ...], num_classes: int) -> list[tuple[str, nn.Linear]] | str:
    """The model's linear layers, in order, when it is an MLP ``Linear -> ReLU -> ... -> Linear`` (the last
    the classifier, the first on the whole flattened input), or the reason it is not."""
    order = run_order(model, input_shape)
    found = trap_layers(model, input_shape, order)  # the first layer, its ReLU, the layer reading it (or why not)
    if isinstance(found, str):
        return found
    if found.norm is not None:
        return (f"the first layer's units go through {type(found.norm).__name__}: the affine first layer needs them "
                "straight into the ReLU")
    names = {id(m): n for n, m in model.named_modules()}
    layers = [m for m in order if any(True for _ in m.parameters(recurse=False)) or isinstance(m, nn.ReLU)]
    linears = layers[0::2]
    pattern = (len(layers) % 2 == 1 and all(isinstance(m, nn.Linear) for m in linears)
               and all(isinstance(m, nn.ReLU) for m in layers[1::2])
               and all(b.in_features == a.out_features for a, b in zip(linears, linears[1:])))
    if not pattern:
        kinds = " -> ".join(type(m).__name__ for m in layers[:8])
        return f"needs an MLP nn.Linear -> nn.ReLU -> ... -> nn.Linear (the classifier); this model runs {kinds}"
    head = classifier(model, num_classes)
    if head is None or head[1] is not linears[-1]:
        return "the last linear layer must be the classifier (the target logit thresholds the last hidden units)"
    return [(names[id(m)], m) for m in linears]


def switch_points(hidden: Tensor, second: nn.Linear, a: Tensor, c: Tensor, gain: float, slope: float,
                  spread_rows: Tensor | None = None) -> Tensor:
    """Each hidden vector's threshold at which the target logit (class 0) overtakes the others' log-sum-exp
    (``spread_rows``: added to the other classes' scaled rows, ``runner_up_rows``)."""
    w, b = second.weight.detach().double(), second.bias.detach().double()
    rest = gain * w[1:] + (0 if spread_rows is None else spread_rows)
    others = (hidden @ rest.T + b[1:]).logsumexp(1)
    base = gain * hidden @ w[0] + b[0] + slope * (hidden @ a)
    return (base - others) / (slope * (hidden @ c))


def runner_up_rows(hidden: Tensor, second: nn.Linear, c: Tensor, gain: float, spread: float,
                   gen: torch.Generator) -> Tensor | None:
    """The projections added to the other classes' rows (``ThresholdBinsConfig.spread``): random unit
    directions of the hidden units, orthogonal to ``c`` (the lifted bias: no constant logit), scaled to
    ``spread`` times the spread of the honest scaled logits on the auxiliary images; None at 0."""
    if spread == 0:
        return None
    e = torch.randn(second.out_features - 1, second.in_features, generator=gen, dtype=torch.float64)
    unit = c / c.norm()
    e -= (e @ unit)[:, None] * unit
    e /= e.norm(dim=1, keepdim=True)
    honest = gain * hidden @ second.weight.detach().double()[1:].T
    return e * (spread * float(honest.std()) / float((hidden @ e.T).std().clamp_min(1e-12)))


def binned_model(model: nn.Module, biases: dict[str, Tensor], head_name: str, a: Tensor, c: Tensor,
                 t: float, gain: float, slope: float, spread_rows: Tensor | None = None) -> nn.Module:
    """The model sent for threshold ``t``: the honest weights, the hidden layers' lifted biases (layer name
    -> bias), the scaled classifier with the target row's threshold in its weights."""
    sent = copy.deepcopy(model)
    head = sent.get_submodule(head_name)
    with torch.no_grad():
        for name, bias in biases.items():
            layer = sent.get_submodule(name)
            layer.bias.copy_(bias.to(layer.bias.dtype))
        w = gain * head.weight.double()
        w[0] += slope * (a - t * c)
        if spread_rows is not None:
            w[1:] += spread_rows
        head.weight.copy_(w.to(head.weight.dtype))
    return sent


def read_bin(w0: Tensor, b0: Tensor, w1: Tensor, b1: Tensor, fill: Tensor | None = None) -> Tensor | None:
    """The image a bin's two consecutive first-layer updates hold: a unit's weight difference over its bias
    difference (``x_n`` exactly when one sample switched), the unit with the largest bias difference first;
    None for an empty bin. A zero entry in either update is no reading (a pruning's zero, or a kept entry
    facing a pruned one, differences to the update itself): units whose bias is zero in either are skipped,
    and each pixel is taken from the first unit whose weight entry is non-zero in both (adaptive to
    GradPrune; without a pruning every entry is non-zero and the first unit gives the whole image). Pixels
    no unit reads are ``fill`` (the attacker's auxiliary mean image), else 0."""
    dw, db = w1 - w0, b1 - b0
    if not torch.isfinite(db).all() or not torch.isfinite(dw).all():
        return None
    valid = (b0 != 0) & (b1 != 0) & (db != 0)
    if not valid.any():
        return None
    kept = (w0 != 0) & (w1 != 0)
    image = torch.zeros_like(dw[0]) if fill is None else fill.to(dw.dtype).clone()
    have = torch.zeros_like(kept[0])
    for j in torch.argsort(db.abs() * valid, descending=True)[: int(valid.sum())].tolist():
        new = kept[j] & ~have
        image[new] = dw[j, new] / db[j]
        have |= new
        if bool(have.all()):
            break
    return image if bool(have.any()) else None


def thresholds_of(points: Tensor, queries: int) -> Tensor:
    """``queries`` thresholds: the switch points' inner quantiles (``queries - 1`` bins of equal auxiliary
    mass) between one below every point and one above."""
    inner = torch.quantile(points, torch.linspace(0, 1, queries, dtype=torch.float64)[1:-1])
    span = float(points.max() - points.min()) or 1.0
    return torch.cat([points.min()[None] - span, inner, points.max()[None] + span])


def read_sweeps(sweeps: list[list[tuple[Tensor, Tensor]]], fill: Tensor, setting: Setting,
                ends: bool = False) -> tuple[list[Tensor], int, int]:
    """The images read from the accepted updates of every direction's sweep: first the points where bins of
    two directions meet (``bin_lines.crossings``: exact, one shared sample, or a line two share cut by a
    third), with ``ends`` the two ends of every line bin inside the input range (``bin_lines.box_ends``),
    then each bin read alone (``read_bin``), the attacker's own order (the certificate keeps the first
    ``num_samples``); the empty bins; the crossings."""
    lo, hi = setting.input_range
    pairs = [list(zip(updates[:-1], updates[1:])) for updates in sweeps]
    hulls = [[bin_hull(w0, b0, w1, b1) for (w0, b0), (w1, b1) in bins] for bins in pairs]
    crossed = crossings(hulls) if len(sweeps) > 1 else []
    cut = [e for bins in hulls for h in bins if h is not None for e in box_ends(h, lo, hi)] if ends else []
    images, empty = [p.float().clamp(lo, hi).reshape(setting.input_shape) for p in crossed + cut], 0
    for (w0, b0), (w1, b1) in (pair for bins in pairs for pair in bins):
        image = read_bin(w0, b0, w1, b1, fill)
        if image is None:
            empty += 1
            continue
        images.append(image.float().clamp(lo, hi).reshape(setting.input_shape))
    return images, empty, len(crossed)


def _aux_images(threat: ThreatModel) -> Tensor:
    """The attacker's auxiliary images (its out-of-distribution ones when it has no others)."""
    aux = threat.aux
    if aux is None:
        return torch.empty(0)
    return aux.images if len(aux.images) or aux.ood is None else aux.ood


@register
class ThresholdBins(ServerAttack):
    """The honest first layer lifted to fire for every sample; the classifier bins the batch over queries."""

    name = "threshold_bins"
    one_round_reads = False  # differences of consecutive thresholds' updates: nothing through fresh encodings
    Config = ThresholdBinsConfig
    capabilities = Capabilities(protocols=frozenset({"fedsgd"}), server="malicious", needs_aux=True,
                                threat=frozenset({"labels"}))
    budgets = {"quick": {}, "paper": {}}
    paper_budget = "analytic (ours): one query per threshold, queries - 1 bins"

    @classmethod
    def _refuses(cls, setting: Setting, threat: ThreatModel) -> str | None:
        chain = relu_chain(setting.model, tuple(setting.input_shape), setting.num_classes)
        if isinstance(chain, str):
            return chain
        if setting.num_classes < 2:
            return "needs two or more classes (the target logit against the others)"
        if threat.aux is not None and len(_aux_images(threat)) < 2:
            return "needs 2 or more auxiliary images (the lift and the thresholds are their statistics)"
        return None

    def _interrogate(self, client: ClientQuery, setting: Setting, threat: ThreatModel, device: torch.device,
                     gen: torch.Generator) -> Reconstruction:
        c_ = self.config
        chain = relu_chain(setting.model, tuple(setting.input_shape), setting.num_classes)
        (first_name, _), (head_name, head) = chain[0], chain[-1]
        aux = _aux_images(threat)
        mean_image = aux.flatten(1).double().mean(0)
        biases, hidden = lifted_chain([m for _, m in chain[:-1]], aux, c_.lifted, gen)
        c = biases[-1] / biases[-1].pow(2).sum()
        spread_rows = runner_up_rows(hidden, head, c, c_.gain, c_.spread, gen)
        queries = c_.queries or setting.num_samples + 1
        lift = {name: bias for (name, _), bias in zip(chain[:-1], biases)}
        sweeps, sent, obs, refused = [], None, None, None
        known, budget = defense_known(setting, threat), client.max_rounds
        share = None if budget is None else max(1, budget // (c_.directions * queries))  # every query its rounds
        repeats, fewest = repeats_for(known, c_.repeats, share), None
        for _ in range(c_.directions):
            a = torch.randn(head.in_features, generator=gen, dtype=torch.float64)
            if c_.directions > 1:  # every unit's coefficient of one size: no unit where another term dominates
                a = a.sign()
            a /= a.norm()
            points = switch_points(hidden, head, a, c, c_.gain, c_.slope, spread_rows)
            updates = []
            for t in thresholds_of(points, queries).tolist():
                sent = binned_model(setting.model, lift, head_name, a, c, t, c_.gain, c_.slope, spread_rows)
                try:
                    obs, answered = query_averaged(client, sent, repeats)
                    fewest = answered if fewest is None else min(fewest, answered)
                except ModelRefused as err:  # adaptive to a client that limits differences of its updates: skip
                    refused = err            # the threshold, keep the next (a wider bin between the accepted ones)
                    continue
                updates.append((obs.update[f"{first_name}.weight"].double(), obs.update[f"{first_name}.bias"].double()))
            sweeps.append(updates)
        if obs is None:
            raise refused
        images, empty, crossed = read_sweeps(sweeps, mean_image, setting, c_.box_ends)
        found = torch.stack(images) if images else torch.empty(0, *setting.input_shape)
        labels, source = server_labels(obs, setting, threat)
        return Reconstruction(fill_batch(found, setting.num_samples, setting.input_range), labels.cpu(), 0.0, [], {
            "labels": source, "bins": c_.directions * (queries - 1), "empty_bins": empty, "candidates": len(images),
            "crossings": crossed, "layer": first_name, "refused_thresholds": c_.directions * queries - sum(map(len, sweeps)),
            "lifted": len(biases), "lifted_share": c_.lifted, "gain": c_.gain, "slope": c_.slope, "directions": c_.directions,
            "spread": c_.spread, "repeats": repeats_line(repeats, known, fewest, share) + " per threshold",
            "malicious_model": sent})
