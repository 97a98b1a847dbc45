"""TAG: Gradient Attack on Transformer-based Language Models (Deng et al. 2021).

The attacker optimises continuous token embeddings ``E`` (B x L x D, fed to the model past its embedding
lookup: ``model(inputs_embeds=E)``) so that the update they produce matches the observed one under
``sum_l ||d_l||^2 + alpha * w_l * ||d_l||_1`` (``objectives.tag_distance_layers``), with Adam, then maps
each position to its nearest vocabulary token (Euclidean distance to the rows of the token embedding).

What the attacker uses besides the update, and the choices where the paper is vague (stated):
- The token embedding's own gradient cannot be produced by continuous embeddings, so it is left out of
  the matching (masked). When it is in the update (an embedding the client trains), its rows are
  non-zero exactly for the tokens of the batch (for a causal LM, the last position of a sequence has no
  target and no gradient): ``token_bag`` reads that set, and the final projection picks the nearest
  token among it. Gupta et al. 2022 and Wu et al. 2023 (Sec. 4.2) name this leak; Wu et al. freeze the
  embedding to remove it (``transformer3-tied``), and then the projection searches the whole vocabulary.
  Under noise every row is non-zero: the bag is then the rows whose norm stands out (a robust z-score
  over the rows, median and MAD), at most B x L of them.
- Labels. A classifier's: granted, or restored from the output layer as for images (``labels_for``). A
  causal LM's next tokens: granted (``threat.labels: known``), or tied to the guess itself: the soft
  label at position t is softmax(-||E_{t+1} - e_v||^2 / T) over the candidate tokens v (the bag, else
  the vocabulary), so labels and inputs are one variable, as they are one text (the last position has
  no target, as in the client's loss). The temperature is relative to the embedding's scale: T = tau *
  2 D s^2, the expected squared distance of two token embeddings (s their standard deviation, D their
  width). An absolute T = 1 against transformer3's N(0, 1) embeddings (squared distances ~192) made the
  labels one-hot with vanishing gradients: the guess kept the bag but lost the order (token accuracy
  0-0.375 at L = 8 after 200-400 iterations; 0.75-0.875 with tau = 0.25, 7 of 8 being the most, the last
  token not being in the bag).
- The L1 weights ``w_l`` decrease linearly with the layer (``objectives.tag_weights``), alpha = 0.1
  (breaching's TAG: scale 0.1 with a decreasing schedule it calls a guess). Defenses (Wu et al. 2023,
  appendix A): a pruned update is matched on its non-zero coordinates only; a sign-compressed update of
  one sample through Eq. 4's hinge in both terms; B > 1 through a tanh surrogate of sign (``Replica``).
- Budgets: ``paper`` is Deng et al.'s / breaching's 1,000 iterations. ``quick`` is 600 (measured in
  bench/bench_text.py: without the token bag, TAG at 300 iterations recovers half the tokens it recovers
  at 1,000; at 600, 93% of them).
- Initial embeddings are N(0, s^2), s the standard deviation of the model's token embedding (the
  attacker knows the model). Adam, step ``lr`` (breaching: 0.05) with a linear warm-up over ``warmup``
  iterations and a cosine decay after. Restarts run one after another; the winner is the lowest final
  objective (never the ground truth).
"""

from __future__ import annotations

import math

import torch
from pydantic import Field
from torch import Tensor

from guardfl.redteam.attacks.base import Attack, Capabilities, NotApplicable, OptimisationConfig, Reconstruction
from guardfl.redteam.attacks.compute import progress_bar
from guardfl.redteam.attacks.labels import labels_for
from guardfl.redteam.attacks.optimisation.engine import ObjectiveWeights, Replica
from guardfl.redteam.attacks.registry import register
from guardfl.redteam.attacks.text.textleak import token_bag
from guardfl.redteam.client.simulate import Observation
from guardfl.redteam.modality.text.models import embedding_names, is_text_model, next_token_labels


class TAGConfig(OptimisationConfig):
    iterations: int = Field(default=1000, ge=1, le=1_000_000, json_schema_extra={"allowed": "an integer in [1, 1000000]"})
    lr: float = Field(default=0.05, gt=0, json_schema_extra={"allowed": "> 0"})
    warmup: int = Field(default=50, ge=0, le=1_000_000, json_schema_extra={"allowed": "an integer in [0, 1000000] (iterations)"})
    alpha: float = Field(default=0.1, ge=0, json_schema_extra={"allowed": ">= 0 (weight of the L1 term)"})
    tau: float = Field(default=0.25, gt=0, json_schema_extra={
        "allowed": "> 0 (temperature of tied soft labels, in units of the mean squared distance of two token embeddings)"})
    use_bag: bool = True


@register
class TAG(Attack):
    """Deng et al. 2021: L2 + L1 gradient matching over continuous token embeddings, nearest token after."""

    name = "tag"
    Config = TAGConfig
    capabilities = Capabilities(modalities=frozenset({"text"}))
    #: quick: 600, where TAG has nearly converged without the token bag (transformer3-tied, next tokens
    #: granted, B = 1, L = 16, 3 sequences: token accuracy 0.31 at 300 iterations, 0.62 at 600, 0.67 at 1,000;
    #: with the bag 300 already reach 0.94, so the bag alone would not justify 600)
    budgets = {"quick": {"iterations": 600}, "paper": {"iterations": 1000}}
    paper_budget = ("Deng et al. 2021 / breaching's TAG: Adam step 0.05, 1,000 iterations with a 50-iteration warm-up, "
                    "L1 weight 0.1 with decreasing per-layer weights")

    def check(self, observation, knowledge) -> None:
        if not is_text_model(observation.model):
            raise NotApplicable("tag: the model does not follow the text-model protocol (task, get_input_embeddings, "
                                "inputs_embeds)")

    def _reconstruct(self, observation, knowledge, device, gen) -> Reconstruction:
        c = self.config
        model = observation.model
        causal = model.task == "causal-lm"
        n, length = observation.num_samples, observation.input_shape[0]
        emb_name = embedding_names(model)[0]
        table = model.get_input_embeddings().weight.detach().to(device)
        bag = None
        if emb_name is not None and emb_name in observation.update and c.use_bag:
            bag = token_bag(observation.update[emb_name], n * length)
        # the embedding's gradient is out of reach of continuous embeddings: match everything else
        view = _without(observation, emb_name)
        replica = Replica(view, knowledge, ObjectiveWeights(distance="tag", tag_alpha=c.alpha), device)
        candidates = table if bag is None else table[bag.to(device)]
        if causal:
            labels = knowledge.labels.to(device) if knowledge.labels is not None else None
            source = "known" if labels is not None else "tied"
        else:
            labels, source = labels_for(observation, knowledge)
        vocab = observation.num_classes
        scale = float(table.std())
        temperature = c.tau * 2 * table.shape[1] * scale**2  # tau relative to the embeddings' squared distances
        objective = tag_objective(replica, labels, candidates, bag, vocab, temperature)
        results = []
        bar = progress_bar(c.progress, c.iterations * c.restarts, self.name)
        for _ in range(c.restarts):
            e0 = (scale * torch.randn(n, length, table.shape[1], generator=gen)).to(device)
            e = optimise_embeddings(objective, e0, c.iterations, c.lr, c.warmup, None if bar is None else bar.update)
            value = float(objective(e).detach())  # one read-back per restart, after its loop
            results.append((value if math.isfinite(value) else float("inf"), e))
        if bar is not None:
            bar.close()
        best = min(range(len(results)), key=lambda i: results[i][0])
        value, e = results[best]
        tokens = nearest_tokens(e, candidates)
        if bag is not None:
            tokens = bag.to(device)[tokens]
        if causal:
            out_labels = labels if labels is not None else next_token_labels(tokens)
        else:
            out_labels = labels
        info = {"labels": source, "winner": best, "bag": None if bag is None else int(len(bag))}
        return Reconstruction(tokens.cpu(), out_labels.cpu(), value, [r[0] for r in results], info)


def tag_objective(replica: Replica, labels: Tensor | None, candidates: Tensor, bag: Tensor | None, vocab: int,
                  temperature: float):
    """TAG's objective of the embeddings ``x`` (B x L x D): the replica's gradient distance, with the granted
    labels or a causal LM's soft labels tied to ``x`` (``_tied_labels``)."""

    def objective(x: Tensor) -> Tensor:
        y = labels if labels is not None else _tied_labels(x, candidates, bag, vocab, temperature)
        return replica.objective(x, y)

    return objective


def optimise_embeddings(objective, e0: Tensor, iterations: int, lr: float, warmup: int, step=None) -> Tensor:
    """Adam on the embeddings from ``e0`` with a linear warm-up and a cosine decay (``_schedule``); ``step``
    (e.g. a progress bar's ``update``) is called with 1 after each iteration. Nothing is read back to the
    host inside the loop: on a GPU the iterations queue without a synchronisation. Returns the detached
    final embeddings."""
    e = e0.detach().clone().requires_grad_(True)
    opt = torch.optim.Adam([e], lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: _schedule(i, iterations, warmup))
    for _ in range(iterations):
        opt.zero_grad(set_to_none=True)
        objective(e).backward()
        opt.step()
        sched.step()
        if step is not None:
            step(1)
    return e.detach()


def _schedule(i: int, iterations: int, warmup: int) -> float:
    """Linear warm-up over ``warmup`` iterations, then a cosine decay to 0 at ``iterations``."""
    if warmup and i < warmup:
        return (i + 1) / warmup
    span = max(1, iterations - warmup)
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (i - warmup) / span)))


def nearest_tokens(e: Tensor, candidates: Tensor) -> Tensor:
    """Per position, the index of the candidate embedding row nearest to ``e`` (Euclidean): (B, L)."""
    d = torch.cdist(e.reshape(-1, e.shape[-1]), candidates)
    return d.argmin(-1).reshape(e.shape[:-1])


def _tied_labels(e: Tensor, candidates: Tensor, bag: Tensor | None, vocab: int, tau: float) -> Tensor:
    """A causal LM's soft next-token labels tied to the guess: position t's label is the softmax of
    -||e_{t+1} - c_v||^2 / tau over the candidate tokens (in the vocabulary's coordinates); the last
    position none (a zero row, skipped by the loss). The squared distances come from one matrix product
    (||e||^2 - 2 e.c + ||c||^2): over the whole vocabulary the broadcast difference would be a
    B x L x 50,257 x 96 tensor per iteration (1.2 GB at B = 4, L = 16: 20 s an iteration on a CPU)."""
    nxt = e[:, 1:]
    d = nxt.pow(2).sum(-1, keepdim=True) - 2 * nxt @ candidates.T + candidates.pow(2).sum(-1)  # (B, L-1, V')
    p = torch.softmax(-d / tau, dim=-1)
    if bag is not None:
        full = p.new_zeros(*p.shape[:2], vocab)
        p = full.index_copy(2, bag.to(p.device), p)
    return torch.cat([p, p.new_zeros(p.shape[0], 1, p.shape[2])], dim=1)


def _without(observation: Observation, name: str | None) -> Observation:
    """``observation`` with parameter ``name`` left out of the matching (the replica then holds it fixed and
    never differentiates it: cheaper than a mask over 50,257 x 96 zeros)."""
    if name is None or name not in observation.update:
        return observation
    from dataclasses import replace

    update = {k: v for k, v in observation.update.items() if k != name}
    matched = None if observation.matched is None else {k: v for k, v in observation.matched.items() if k != name}
    return replace(observation, update=update, matched=matched)
