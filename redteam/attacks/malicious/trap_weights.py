"""Trap weights: Robbing the Fed's bins written into the honest model's own first linear layer.

The adaptive malicious server of issue 34: it has read ``guardfl/inspect.py`` and builds a model that
passes its weight checks (Boenisch et al. 2023, "When the Curious Abandon Honesty": the honest
architecture's own layers made to leak; Garov et al. 2024, SEER: a server disguised against client-side
checks). The architecture is the client's own, so the architecture comparison sees nothing.

Construction, for a model whose first parameterised layer (in forward order) is an ``nn.Linear(d -> U)``
on the flattened input, followed by an ``nn.ReLU`` (optionally after an affine ``nn.BatchNorm1d``, below)
and an ``nn.Linear(U -> K)`` that reads those units (FC-2, MLPs; an affine GroupNorm or a LayerNorm there
too, below; elsewhere: not applicable, with the reason):

- The ``U`` rows form ``chains`` measurement chains of ``U // chains`` rows (left-over rows never fire).
  Chain c measures ``s = <m_c, x>`` along a random unit direction ``m_c``; its rows cut ``s`` at
  equal-mass quantiles of the attacker's auxiliary data (``threat.aux``; a Gaussian fitted to the input
  range without it), the first cut below every input: row i fires for the samples with ``s > c_i``.
- Evasion of the weight checks: every row is scaled by its own random factor in [0.5, 2] (no two rows
  equal: the duplicate-row check; the gating is unchanged), the chains' directions are independent (rank
  ``chains``, not one: the rank-one check), the rows are in random order (the biases are no monotone
  sequence), the classifier's rows and biases keep their honest norms and offsets (no zeroed rows, no
  bias gap). A chain's rows stay near multiples of each other, which the near-parallel-rows check refuses
  unless they are disguised (``disguise``, below).
- The next layer's columns of one chain are one random vector ``v_c``, so every row of the chain gets the
  same coefficient ``D_n = v_c . (p_n - y_n)`` for sample n: the difference of two adjacent rows' updates
  (in cut-off order) is ``sum D_n x_n`` over the samples in that bin, and its bias's ``sum D_n``; a
  sample alone in its bin comes back exactly as their ratio (Fowl et al., Eq. 3-4).
- ``column_noise``: relative noise on each row's share of the column, against the shared-columns check
  (``auto``: calibrated on the aux data against an inspecting client, ``evade_columns``; else 0). Ours.
- ``columns``: each cut held by that many rows, each with its own classifier column from a chain's basis
  of that many columns (``trap_groups``): no shared column and no pair of rows that reads, solved per cut
  by the server (the construction that adapts to the shared-columns check and the pairwise isolation
  tests at once, exactly; ``inspect_model``'s group test counts it). Ours.
- ``rows``: a small trap: only ``rows`` rows per chain, cut at the top of the measurement (a bin per
  sample on average), the rest of the layer honest. It reads a few samples exactly and stays under a
  check that counts isolated samples against what the honest model isolates (``inspect_model``'s
  isolation check with a reference): the construction that adapts to that check.
- ``boost``: the trapped rows' classifier columns made that many times larger than the honest ones, so
  their gradients are too: a defense that keeps a layer's largest entries (GradPrune, Outpost) keeps the
  trap's, and noise of a fixed scale (Gaussian, Laplace, Outpost's) is small beside them (the attacker
  knows the defense's configuration). ``auto``, the default: 1000 against a known pruning or noise
  defense, else 1 (as Robbing the Fed's ``boost: auto``; unboosted traps had certified Gaussian 0.01 and
  Outpost clients). ``rows: auto``: as many rows as a known pruning keeps whole, at most 6 (``trap_size``:
  GradPrune 0.99 keeps 2 of FC-2's first layer; a 6-row trap there is cut and reads nothing exactly).
  ``rows: fit``: the size (chains and rows, or the whole layer) that reads most of a shadow client's
  batches of auxiliary images, the client's inspection (with a margin under the isolation limit) and
  defense included (``trap_fit``): the construction that adapts to the isolation check on any data.
- ``peel`` (default on; ours): after the bins, the sent model's first-layer units that hold one sample
  alone are read, checked against that model and peeled (``exclusive_neurons.read_checked``), which reads
  on down a chain whose bins hold one sample each and through the honest rows; ``rows: fit`` sizes the
  trap on that reading (``malicious-adaptive-inspect.yaml``: the passing traps read 24-32 faces exactly,
  0-12 without). Nothing through a normalisation, a pruning's zeros or noise (the checks fail there).
- ``cuts: middle`` (with ``rows``; built against SEER's D-SNR check, ``inspect_model(...,
  disaggregation=True)``, which refuses a model when one sample's weight gradient exceeds 2 times all the
  others' in a layer): boosted rows at the top of the measurement give 1000x gradients to the few samples
  above the cuts, and one of them can dominate the layer (D-SNR 2.2 to 630 measured on FC-2, CIFAR-10
  and LFW batches of 64). Instead the ``rows`` cuts sit around the median, spaced ``1 / (B + 1)`` in
  quantile (one sample per bin on average), so that every sample above the lowest cut, about half the
  batch, fires the boosted rows: the boosted gradient is spread over ~B/2 samples and D-SNR stays near
  ``sqrt(rows) / (B / 2)`` (measured 0.03-0.21), while the difference of two adjacent rows still holds the
  samples of one bin alone. The trapped rows are scaled by ``1 / boost``, so that their activations (and
  the logits of the half of the batch that fires them) stay those of an honest-magnitude unit; the gradient
  into the rows does not depend on their scale. The top row (every sample above the highest cut) is no
  bin and gives no candidate. The isolation check still counts the bins' samples: ``rows`` of 4 to 6 keep
  that count near the honest model's on batches of 64 (it compares counts, not which samples).

Through BatchNorm (``nn.Linear -> nn.BatchNorm1d -> nn.ReLU -> nn.Linear``, e.g. ``fc2bn``): in train mode
every row of a chain normalises to the same standardised measurement, so the cut-offs go in BatchNorm's
affine parameters (``beta_i = -gamma_i c_i``, quantiles of the standardised measurement; the linear rows
keep their honest biases, which BatchNorm cancels), and the recovery undoes BatchNorm's backward pass up
to two batch-wide images estimated on the auxiliary data (``trap_norm``: not bit-exact, SSIM > 0.9 on
most of a batch). It passes the isolation check at the linear layer (BatchNorm mixes the batch there) and
D-SNR; ``inspect_model`` examines the gradient at BatchNorm's output for that. Our construction.

Through GroupNorm (what ``guardfl.dp_compatible`` puts in BatchNorm's place for DP-SGD, groups of 3 or
more channels): a chain's rows are groups, one measuring channel each, the group's other channels
constants spread far apart with tiny random weights, so that the measuring channel normalises to an
almost linear function of the measurement and GroupNorm's bias cuts it; GroupNorm couples no samples, so
each row's update divided by its slope differences to single samples exactly (``trap_per_sample``). Ours
too.

Through LayerNorm (``fc2ln``; each sample normalised over all of the layer's units, which couples a
sample's units through its mean and standard deviation): one unit in 16 is a constant spread so far apart
that every sample's standard deviation is the same and the coupling through it negligible; a chain's rows
are one row (each with a tiny random part, so that none repeats), so that every unit of the chain
normalises the same measurement (the layer's mean is linear in the input: it only turns the measurement
direction), and they share one LayerNorm weight, so that the coupling through the mean cancels in adjacent
differences; that weight undoes the normalisation and LayerNorm's bias cuts. The honest units' weights are
rescaled so that they compute what they did. Exact (``trap_per_sample``; 1e-5 per pixel for most bins).
Against a known Outpost (whose noise on a layer is 0.8 times the variance of its current values) the
constants of both per-sample traps go in the weights, not the biases (``trap_per_sample.carried``):
constants of 1e4 in a bias drowned every bin in ~1e8 noise, and the client looked protected. Ours.

Against FedAvg (``scales``, ``auto``: equal against a FedAvg client): over several local steps the
classifier columns of a chain's rows drift apart, each by the learning rate times the sum of the batch's
logit gradients weighted by that row's activations, so the rows' coefficients per sample are no longer
equal and adjacent differences no longer cancel. The drift between two adjacent rows is proportional to
the difference of their activations: with random scales, up to the whole measurement's range; with one
scale per chain, at most the bin's width. So the rows share one scale (each with a tiny random part, so
that none repeats). Measured (FC-2, 64 LFW faces, whole layer, lr 0.1, SSIM > 0.9): 4 local steps of 16,
20 faces exactly instead of 2; 8 of 8, 11 instead of 1; 3 epochs of 4 x 16, 6 instead of 0; one step of
64, 40 and 36 (docs/research/malicious-server.md 2b). The small traps gain little (a few rows drift little).
Through GroupNorm ``equal`` also undoes the normalisation's scale: a measuring row's update was ~1e-4 of
its weights, and a FedAvg delta (a difference of float32 weights) lost the bins in rounding. Ours.

Against the near-parallel-rows check (``disguise``, "auto": on for a small trap): a chain's rows are near
multiples of each other (``|cos|`` ~1), which ``inspect_model`` refuses at 0.99. Each such row gets a random
part of ``rho`` times its norm that images barely see (``trap_chain.unseen``: white noise through a
Laplacian twice, the auxiliary images' principal directions projected out), ``rho`` 0.14: two rows of a
chain at ``|cos|`` ~0.98; the measurement moves by a few per cent of its spread on faces. ``rows: 1`` with
``chains: k``: k single rows, each its own measurement cut at the top (one sample on average), no two rows
alike: nothing to disguise, and a row that holds one sample is read from its own update. Ours.

Recovery: every chain's adjacent differences; one candidate per bin whose bias difference is not
negligible, the ``B`` largest by bias difference over all chains; ``fill_batch`` when fewer. Each chain
is a fresh chance for a sample to be alone in a bin; ``inspect_model``'s isolation check counts the
samples a stronger decoder (peeling across bins) would read.

The client's inspection (``client.inspect``) runs the batch checks too: this model is what the isolation
check exists for, and a client that inspects refuses it (``ModelRefused``: nothing sent).
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from guardfl.redteam.attacks.analytic import exclusive
from guardfl.redteam.attacks.analytic.exclusive_neurons import SAME, first_dense, read_checked
from guardfl.redteam.attacks.base import DECODING_THREAT, Capabilities, Reconstruction
from guardfl.redteam.attacks.dense import TrapLayers, trap_layers  # noqa: F401 - re-exported
from guardfl.redteam.attacks.setting import Setting
from guardfl.redteam.attacks.registry import register
from guardfl.redteam.attacks.malicious import trap_norm
from guardfl.redteam.attacks.malicious.trap_norm import recover_through_norm
from guardfl.redteam.attacks.malicious.trap_chain import Trap, auto_rho, chain_draw, columns, disguise, equal_rows
from guardfl.redteam.attacks.malicious.trap_groups import craft_groups, group_bins
from guardfl.redteam.attacks.malicious.trap_per_sample import craft_grouped, craft_layer_norm, through
from guardfl.redteam.attacks.malicious.evade_columns import calibration_batch, least_passing
from guardfl.redteam.attacks.malicious.trap_config import COLUMN_NOISE_LEVELS, TrapWeightsConfig  # noqa: F401 - re-exported
from guardfl.redteam.attacks.malicious.trap_fit import TrapPlan, fit
from guardfl.redteam.attacks.malicious.trap_cuts import cuts_for, norm_cuts_for
from guardfl.redteam.attacks.malicious.trap_size import TRAP_BOOST, auto_rows, boost_for  # noqa: F401 - TRAP_BOOST re-exported
from guardfl.redteam.attacks.malicious.robbing_the_fed import bin_differences, candidates
from guardfl.redteam.attacks.malicious.server import (ServerAttack, defense_known, fill_batch, query_averaged,
                                                    repeats_for, repeats_line, server_labels)
from guardfl.redteam.client.simulate import ClientQuery, ModelRefused, Observation
from guardfl.redteam.threat import ThreatModel, defense_kinds


def craft(model: nn.Module, layers: TrapLayers, input_shape: tuple[int, ...],
          aux: Tensor | None, chains: int, column_noise: float, input_range: tuple[float, float],
          gen: torch.Generator, rows: int | None = None, samples: int = 1,
          boost: float = 1.0, cuts: str = "top", equal: bool = False, outpost: bool = False, per_cut: int = 1) -> Trap:
    """The trapped model (a deep copy) and what the recovery needs (``Trap``). ``rows``: rows per chain at
    the top of the measurement (``cuts="top"``) or around its median (``cuts="middle"``: the rows also
    scaled by ``1 / boost``), the other rows keep their honest weights; None: the whole layer, ``U //
    chains`` rows per chain. Through a BatchNorm the cut-offs go in its affine parameters (``trap_norm``).
    ``equal``: a chain's rows share one scale, each with a tiny random part (``equal_rows``), instead of
    their random scales (through BatchNorm: one BatchNorm weight per chain): adapted to FedAvg
    (``TrapWeightsConfig.scales``). ``outpost``: through GroupNorm or LayerNorm, the constants go in the
    weights, not the biases (``trap_per_sample.carried``): adapted to Outpost's variance-scaled noise.
    ``per_cut`` > 1: each cut held by that many rows with their own columns (``trap_groups``)."""
    if per_cut > 1 and layers.norm is None:
        return craft_groups(model, layers, aux, chains, per_cut, input_range, gen, rows, samples, boost, cuts)
    if isinstance(layers.norm, (nn.GroupNorm, nn.LayerNorm)):
        per_sample = craft_grouped if isinstance(layers.norm, nn.GroupNorm) else craft_layer_norm
        return per_sample(model, layers, aux, chains, column_noise, input_range, gen, rows, samples, boost, cuts, outpost,
                          equal)
    sent = copy.deepcopy(model)
    modules = dict(sent.named_modules())
    first, second = modules[layers.first_name], modules[layers.second_name]
    norm = None if layers.norm_name is None else modules[layers.norm_name]
    units, d = first.out_features, first.in_features
    k = units // chains if rows is None else min(rows, units // chains)
    order = torch.randperm(units, generator=gen)
    chain_rows, norm_chains = [], []
    with torch.no_grad():
        if rows is None:
            first.weight.zero_()
            (first.bias if norm is None else norm.bias).fill_(-1.0)  # left-over rows never fire
        for c in range(chains):
            m, scale = chain_draw(d, k, rows, cuts, boost, gen)
            chain = order[c * k:(c + 1) * k]
            if norm is None:
                cut = cuts_for(None if aux is None else aux.flatten(1).double() @ m, k, rows, cuts, samples, input_range, m)
                rows_w = scale[:, None] * m[None, :]
                if equal:  # drawn after the chain's other draws: the random-scale trap is unchanged
                    scale = scale.mean().expand(k)
                    rows_w = equal_rows(m, k, float(scale[0]), gen)
                first.weight[chain] = rows_w.to(first.weight.dtype)
                first.bias[chain] = (-scale * cut).to(first.bias.dtype)
            else:  # the linear rows measure (their bias cancels in the BatchNorm); its affine cuts
                cut = norm_cuts_for(trap_norm.standardised(aux, m), k, rows, cuts, samples)
                alpha = torch.rand(k, generator=gen, dtype=torch.float64) * 1.5 + 0.5
                first.weight[chain] = (alpha[:, None] * m[None, :]).to(first.weight.dtype)
                if equal:  # one BatchNorm weight per chain (the rows' own scales differ and cancel in it)
                    scale = scale.mean().expand(k)
                norm.weight[chain] = scale.to(norm.weight.dtype)
                norm.bias[chain] = (-scale * cut).to(norm.bias.dtype)
                norm_chains.append((m, alpha, scale))
            columns(second, chain, boost, column_noise, gen)
            chain_rows.append(chain)
    return Trap(sent, chain_rows, f"{layers.first_name}.weight", f"{layers.first_name}.bias", layers.norm_name,
                norm_chains if norm is not None else None)


def recover(weight: Tensor, bias: Tensor, chains: list[Tensor], samples: int, input_shape: tuple[int, ...],
            input_range: tuple[float, float], min_mass: float, top_row: bool = True,
            mixes: list[Tensor] | None = None) -> tuple[Tensor, int]:
    """Candidates from every chain's adjacent row differences (see the module docstring): ``samples``
    images and the number of bins that held one. ``top_row=False``: a chain's last row is no bin (it
    holds every sample above it: ``cuts="middle"``). ``mixes``: cuts of several rows (``trap_groups``)."""
    parts = ([bin_differences(weight[rows], bias[rows]) for rows in chains] if mixes is None else
             [group_bins(weight, bias, rows, mix) for rows, mix in zip(chains, mixes)])
    if not top_row:
        parts = [(dw[:-1], db[:-1]) for dw, db in parts]
    return candidates(torch.cat([dw for dw, _ in parts]), torch.cat([db for _, db in parts]), input_shape, samples,
                      input_range, min_mass)


@register
class TrapWeights(ServerAttack):
    """Robbing the Fed's bins inside the honest first linear layer, disguised against the weight checks."""

    name = "trap_weights"
    Config = TrapWeightsConfig
    capabilities = Capabilities(protocols=frozenset({"fedsgd", "fedavg"}), server="malicious",
                                threat=frozenset({"labels", "defense"}) | DECODING_THREAT)  # aux data; the defense sizes boost: auto; never bn/fedavg
    budgets = {"quick": {}, "paper": {}}
    paper_budget = "analytic (one query), as Robbing the Fed; chains of U / chains bins"

    @classmethod
    def _refuses(cls, setting: Setting, threat: ThreatModel) -> str | None:
        found = trap_layers(setting.model, tuple(setting.input_shape))
        if isinstance(found, str):
            return found
        if found.first.out_features // 2 < 2:
            return f"the first linear layer has {found.first.out_features} units: too few for chains of bins"
        return None

    def refuses(self, setting: Setting) -> str | None:
        found, k = trap_layers(setting.model, tuple(setting.input_shape)), self.config.columns
        if k == 1 or isinstance(found, str):
            return None
        if found.norm is not None:
            return (f"columns: {k} needs the first layer's units straight into the ReLU; they go through "
                    f"{type(found.norm).__name__} here (columns: 1 only)")
        if k > found.second.out_features or 2 * k > found.first.out_features:
            return (f"columns: {k} is past the {found.second.out_features} outputs of the layer reading the trap or half "
                    f"its {found.first.out_features} units (allowed: 1 to {min(found.second.out_features, found.first.out_features // 2)})")
        return None

    def _crafted(self, build, client: ClientQuery, setting: Setting, threat: ThreatModel, gen: torch.Generator,
                 rows: int | None, per_cut: int = 1) -> tuple[Trap, str]:
        """The trap ``build(column_noise)`` and the certificate's line on its noise: ``column_noise: auto``
        calibrates it against an inspecting client's shared-columns check (``evade_columns``)."""
        noise = self.config.column_noise
        if noise != "auto":
            return build(float(noise)), f"{noise:g}"
        if per_cut > 1:
            return build(0.0), f"0 (auto: columns {per_cut}, no two rows share a column)"
        if not getattr(client, "inspect", False) or rows == 1:
            return build(0.0), "0 (auto: " + ("single rows share no column)" if rows == 1 else "the client does not inspect)")
        x, y, what = calibration_batch(threat.aux, setting)
        trap, _, line = least_passing(build, lambda t: t.sent, COLUMN_NOISE_LEVELS, gen, x, y, what)
        return trap, line

    def _rows(self, setting: Setting, layers: TrapLayers, chains: int, known: bool) -> tuple[int, int | None, str]:
        """Chains, rows per chain (None: the whole layer) and the certificate's line on the rows: ``rows:
        auto`` fits a known pruning (``trap_size.auto_rows``)."""
        rows = self.config.rows
        if rows != "auto":
            return chains, rows, str(rows or "all")
        first = layers.first
        parameters = sum(p.numel() for p in setting.model.parameters())
        return auto_rows(setting.defense_config if known else None, first.out_features, first.in_features, parameters,
                         chains, self.config.cuts)

    def plan(self, setting: Setting, threat: ThreatModel) -> TrapPlan:
        """What every trap this attack builds against ``setting`` shares (see ``TrapPlan``)."""
        c, layers = self.config, trap_layers(setting.model, tuple(setting.input_shape))
        known = threat.defense == "known"
        return TrapPlan(layers, None if threat.aux is None else threat.aux.images, known,
                        (boost_for(setting.defense_config) if known else 1.0) if c.boost == "auto" else float(c.boost),
                        c.scales == "equal" or (c.scales == "auto" and setting.protocol.name == "fedavg"),
                        known and any(leaf.kind == "outpost" for leaf in defense_kinds(setting.defense_config)))

    def build(self, plan: TrapPlan, chains: int, rows: int | None, client: ClientQuery, setting: Setting,
              threat: ThreatModel, gen: torch.Generator, columns: int | None = None) -> tuple[Trap, dict]:
        """The trap of ``chains`` chains of ``rows`` rows (None: the whole layer) of ``columns`` rows per cut
        (None: the config's), disguised and its columns noised against ``client``'s inspection, and its lines
        for the certificate."""
        c, shape, n = self.config, tuple(setting.input_shape), setting.num_samples
        per_cut = c.columns if columns is None else columns
        rho = (auto_rho() if rows is not None or per_cut > 1 else 0.0) if c.disguise == "auto" else float(c.disguise)
        disguised = []

        def build(noise: float) -> Trap:  # the model sent, disguised: what the column noise is calibrated on
            made = craft(setting.model, plan.layers, shape, plan.aux, chains, noise, setting.input_range, gen, rows, n,
                         plan.boost, c.cuts, plan.equal, plan.outpost, per_cut)
            disguised[:] = [disguise(made.rows(), rho, shape, plan.aux, gen)]
            return made

        trap, noise = self._crafted(build, client, setting, threat, gen, rows, per_cut)
        return trap, {"chains": chains, "bins": sum(int(r.shape[0]) for r in trap.chains), "column_noise": noise,
                      **({"columns": f"{per_cut} rows per cut, each its own column"} if per_cut > 1 else {}),
                      "boost": plan.boost, "cuts": c.cuts if rows else "quantiles",
                      "disguised": f"{disguised[0]} rows, rho {rho:.3g}" if disguised[0] else "none"}

    def read(self, observation: Observation, trap: Trap, plan: TrapPlan, setting: Setting, small: bool) -> tuple[Tensor, int]:
        """The images the update ``observation`` of ``trap`` gives back (``setting.num_samples`` of them,
        ``fill_batch``) and how many bins held one sample; ``small``: a trap of a few rows per chain."""
        c, shape, n, layers = self.config, tuple(setting.input_shape), setting.num_samples, plan.layers
        top_row = c.cuts == "top" or not small
        if trap.norm is None or trap.slopes is not None:  # through GroupNorm: each row divided by its slope
            slopes = torch.ones(1, dtype=torch.float64) if trap.slopes is None else trap.slopes
            w, b = observation.update[trap.weight].double(), observation.update[trap.bias].double()
            return recover(w / slopes.reshape(-1, *[1] * (w.dim() - 1)), b / slopes, trap.chains, n, shape,
                           setting.input_range, c.min_mass, top_row=top_row, mixes=trap.mixes)
        return recover_through_norm(observation.update, trap, layers.norm.eps, plan.aux, n, shape, setting.input_range,
                                    c.min_mass, top_row=top_row)

    def peeled(self, images: Tensor, found: int, observation: Observation, labels: Tensor, source: str) -> tuple[Tensor, int]:
        """The bins' reading ``images`` (its first ``found`` are candidates, the rest copies) with what the
        sent model's first layer holds beyond it (``peel``): the samples its units hold alone, checked
        against the sent model and peeled, repeated (``exclusive_neurons.read_checked``: a chain's top row
        holding one sample gives it, peeling it leaves the next bin's sample alone in the next row, and a
        sample peeled from one chain or an honest row can leave a bin of two holding the other). The checked
        samples come first, then the bins' candidates not among them; and how many were checked. Not
        through a normalisation (no unit is exclusive there) or on a FedAvg update (nothing to check
        against)."""
        layers = first_dense(observation.model, tuple(observation.input_shape), list(observation.update))
        if not self.config.peel or isinstance(layers, str):
            return images, 0
        if source == "known":  # the classes in the batch (an encoding client's soft labels: those with any mass)
            choices = torch.unique(labels) if labels.dim() == 1 else torch.nonzero(labels.sum(0) > 0).flatten()
        else:
            choices = torch.arange(observation.num_classes)
        checked = read_checked(observation, layers, choices.to(observation.update[layers.first_name + ".weight"].device),
                               1e-3, self.config.min_mass, 64).samples
        if not checked.shape[0]:
            return images, 0
        lo, hi = observation.input_range
        ours = checked.float().cpu().clamp(lo, hi)
        theirs = images[:found].flatten(1)
        new = theirs[exclusive.distinct(theirs.double(), SAME * (hi - lo), ours.double())] if found else theirs
        merged = torch.cat([ours, new])[:observation.num_samples].view(-1, *observation.input_shape)
        return fill_batch(merged, observation.num_samples, (lo, hi)), int(checked.shape[0])

    def _interrogate(self, client: ClientQuery, setting: Setting, threat: ThreatModel, device: torch.device,
                     gen: torch.Generator) -> Reconstruction:
        plan = self.plan(setting, threat)
        if self.config.rows == "fit":
            trap, rows, lines = fit(self, plan, client, setting, threat, gen)
            small = rows is not None
        else:
            chains = min(self.config.chains, plan.layers.first.out_features // 2)
            chains, rows, rows_line = self._rows(setting, plan.layers, chains, plan.known)
            trap, lines = self.build(plan, chains, rows, client, setting, threat, gen)
            lines["rows"], small = rows_line, rows is not None
        known = defense_known(setting, threat)  # plan.known is the same test
        repeats = repeats_for(known, self.config.repeats, client.max_rounds)
        lines["repeats"] = f"{repeats} asked; the client refused the first round and sent nothing"  # until one is answered
        try:
            observation, answered = query_averaged(client, trap.sent, repeats)
        except ModelRefused as refused:  # the certificate still says what was sent, and how it was sized
            refused.info = {**lines, "malicious_model": trap.sent}
            raise
        lines["repeats"] = repeats_line(repeats, known, answered, client.max_rounds)
        images, found = self.read(observation, trap, plan, setting, small)
        labels, source = server_labels(observation, setting, threat)
        images, checked = self.peeled(images, found, observation, labels, source)
        norm = plan.layers.norm
        extra = {} if trap.norm is None else {"through": through(norm, trap.norm, plan.aux is not None)}
        if plan.outpost and isinstance(norm, (nn.GroupNorm, nn.LayerNorm)):
            extra["constants"] = "in the weights (adapted to Outpost's noise, which scales with each layer's variance)"
        return Reconstruction(images, labels.cpu(), 0.0, [], {
            "labels": source, **lines, "candidates": found, "checked": checked, "layer": trap.weight.removesuffix(".weight"),
            "scales": "equal" if plan.equal or isinstance(norm, nn.LayerNorm) else "random",
            **extra, "cutoffs": "aux quantiles" if plan.aux is not None else "gaussian guess", "malicious_model": trap.sent})
