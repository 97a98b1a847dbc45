"""Soteria (Sun et al. 2021, "Soteria: Provable defense against privacy leakage in federated learning from
representation perspective", CVPR 2021, Sec. 4; public code github.com/jeremy313/Soteria, also in
TL-System/plato ``examples/gradient_leakage_attacks``). A baseline of the Outpost paper (Wang et al. 2024,
Sec. V: "the pruning rate of the fully connected layer's gradients" 50%, the default here).

For the representation ``r`` feeding a fully connected layer (the input of the ``nn.Linear`` named by
``layer``), each feature ``f`` is scored by ``sum_b ||dr_{b,f}/dx_b|| / |r_{b,f}|`` over the batch, and the
columns of that layer's WEIGHT gradient belonging to the ``prune`` fraction of features with the smallest
scores are zeroed (removing such a feature perturbs the input an attacker reconstructs the most for the
least change of the representation). Its bias gradient and every other layer are left as they are.

Interpretation and deviations (the public code is written for one LeNet):

- Layer: the public code hard-codes LeNet's FC layer (plato: ``list_grad[6]``). Here ``layer`` names an
  ``nn.Linear`` of the model; default: the first one in ``named_modules()`` order. A layer called several
  times in one forward pass is scored on its first call. Its input must be (batch, features).
- Count: exactly ``ceil(prune * (F - 1))`` features of the layer's ``F`` input features
  (``guardfl.ops.selection.prune_count``): the number the public code zeroes (the scores below
  ``np.percentile(scores, prune)``) when scores are distinct; ties are broken by position instead of pruning
  fewer. Any ``prune > 0`` prunes at least one feature of a layer of two or more features; a one-feature
  layer is never pruned. ``last_stats`` counts the weight-gradient entries that were not already zero, so
  a step that changed nothing reports ``fired=False``.
- ``|r|``: the public code divides by the signed ``r_f`` and takes ``|.|`` of the batch sum; here each
  sample's ratio uses ``|r_{b,f}|``. The same for non-negative features (ReLU, sigmoid); with signed
  features the public code's signed terms could cancel.
- ``r_{b,f} = 0`` (a ReLU feature off for sample ``b``): the public code divides by zero (inf or NaN; the
  GradDefense PoC adds 0.1 to every denominator instead). Here sample ``b`` is left out of feature ``f``'s
  sum and the sum is rescaled to the batch size (the mean of the other samples' ratios stands in for it),
  so a feature scores exactly the public code's sum whenever none of its values is 0. A feature that is 0
  for every sample scores +inf and is pruned last: its weight-gradient column is already zero, so
  pruning it would hide nothing (``guardfl.ops.representation.soteria_scores``).
- The gradients ``d(sum_b r_{b,f})/dx`` are exact, one vector-Jacobian product per feature as in the
  public code's loop of backward passes (vectorised over chunks of features on CUDA). This costs ``F``
  backward passes through the layers below ``layer`` per step, which is why the Outpost paper (Fig. 3)
  finds Soteria an order of magnitude slower than plain training.
- At ``step()`` the training graph is gone, so the representation is recomputed from the recorded batch
  inputs with the current weights (those the gradient was computed with) and the model in its mode,
  without updating BatchNorm buffers or consuming the global RNG (``guardfl.ops.model.side_pass``). With
  dropout below ``layer`` the masks differ from the training pass's. With gradient accumulation only the
  last forward pass's inputs are seen.
- Soteria's certified bound (its Theorem 1) is not computed.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, field_validator
from torch import Tensor, nn

from guardfl.defenses.base import Defense, DefenseConfig, StepContext, register
from guardfl.defenses.strength import refuse_zero
from guardfl.errors import ConfigError
from guardfl.ops.model import model_device, require_float_inputs, side_pass, unwrap
from guardfl.ops.representation import feature_input_grad_norms, linear_input, soteria_scores
from guardfl.ops.selection import prune_count, smallest_k_mask
from guardfl.stats import LayerStats, StageStats


class SoteriaConfig(DefenseConfig):
    kind: Literal["soteria"] = "soteria"
    prune: float = Field(default=0.5, ge=0.0, lt=1.0, json_schema_extra={"allowed": "(0, 1)"})
    layer: str | None = Field(
        default=None, json_schema_extra={"allowed": "null (the first nn.Linear) or the name of an nn.Linear module"}
    )

    prune_not_zero = field_validator("prune")(refuse_zero("(0, 1)", "prunes nothing"))


@register
class Soteria(Defense):
    """Soteria (Sun et al. 2021): zero the FC weight-gradient columns of the least input-sensitive features.

    Args:
        prune: the fraction of the FC layer's features whose weight-gradient columns are zeroed.
        layer: the ``nn.Linear`` module's name; ``None``: the first one.
        seed: an integer in [0, 2**32 - 1] for a reproducible stream; ``None`` (the default, as deployed): OS
            entropy.
        nonfinite: ``"raise"`` (default): a NaN or inf in the gradient raises; ``"zero"``: such entries are
            zeroed.
    """

    Config = SoteriaConfig
    needs_params = True
    needs_model = True

    #: after a step: the indices of the features whose weight-gradient columns were zeroed
    last_pruned: list[int] | None = None

    def __init__(
        self, prune: float = 0.5, layer: str | None = None, *, seed: int | None = None, nonfinite: str = "raise"
    ) -> None:
        super().__init__(prune=prune, layer=layer, seed=seed, nonfinite=nonfinite)

    def check_model(self, model: nn.Module) -> None:
        self.find_layer(model)

    def find_layer(self, model: nn.Module) -> tuple[str, nn.Linear]:
        """(name, module) of the layer whose input Soteria scores; ConfigError naming ``soteria.layer``."""
        module = unwrap(model)
        linears = [(n, m) for n, m in module.named_modules() if isinstance(m, nn.Linear)]
        name = self.config.layer
        if name is None:
            if not linears:
                raise ConfigError(
                    "soteria.layer: the model has no nn.Linear layer; Soteria prunes the weight gradient of a "
                    "fully connected layer"
                )
            return linears[0]
        modules = dict(module.named_modules())
        key = name.removeprefix("_module.")
        found = modules.get(key)
        if not isinstance(found, nn.Linear):
            what = "names no module of the model" if found is None else f"is a {type(found).__name__}, not an nn.Linear"
            choices = ", ".join(repr(n) for n, _ in linears) or "none: the model has no nn.Linear"
            raise ConfigError(f"soteria.layer: {name!r} {what}; allowed: null (the first nn.Linear) or one of {choices}")
        return key, found

    def _weight_index(self, ctx: StepContext, name: str, layer: nn.Linear) -> int:
        w = layer.weight
        for i, p in enumerate(ctx.params):
            if p.data_ptr() == w.data_ptr() and p.shape == w.shape and p.dtype == w.dtype:
                return i
        if ctx.names is not None:
            for i, n in enumerate(ctx.names):
                if n.removeprefix("_module.") == f"{name}.weight" and ctx.params[i].shape == w.shape:
                    return i
        raise ConfigError(
            f"soteria.layer: the weight of {name!r} is not among the defended gradients "
            "(is it trainable and in the optimizer?)"
        )

    def _representation(self, model: nn.Module, name: str, layer: nn.Module, x: Tensor) -> tuple[Tensor, Tensor]:
        """The defended layer's input ``r`` ``(samples, features)`` for inputs ``x`` and, per feature and
        sample, the norm of its gradient with respect to the sample's input (``feature_input_grad_norms``)."""
        require_float_inputs(self.kind, x)
        with side_pass(model, model_device(model)) as module:
            xg = x.detach().requires_grad_(True)
            r = linear_input(module, layer, xg)
            if r.dim() != 2 or r.shape[0] != x.shape[0]:
                raise ConfigError(
                    f"soteria.layer: the input of {name!r} has shape {tuple(r.shape)} for a batch of {x.shape[0]}; "
                    "Soteria needs (batch, features)"
                )
            return r, feature_input_grad_norms(r, xg)

    def _apply_(self, grads: list[Tensor], ctx: StepContext) -> StageStats:
        name, layer = self.find_layer(ctx.model)
        idx = self._weight_index(ctx, name, layer)
        r, norms = self._representation(ctx.model, name, layer, ctx.inputs)
        scores = soteria_scores(norms, r)
        features = r.shape[1]
        k = prune_count(self.config.prune, features)
        mask = smallest_k_mask(scores, k).to(grads[idx].device)
        zeroed = int(torch.count_nonzero(grads[idx][:, mask]))
        grads[idx][:, mask] = 0
        self.last_pruned = mask.nonzero().flatten().tolist()
        return StageStats.from_layers(self.kind, tuple(
            LayerStats.counted(ctx.name(i), g.numel(), changed=zeroed if i == idx else 0, zeroed=zeroed if i == idx else 0)
            for i, g in enumerate(grads)
        ))

    # -- many batches that share the weights (the red team's simulation of the defense) -----------------
    def column_masks(self, model: nn.Module, inputs: Tensor) -> tuple[str, Tensor]:
        """(the scored layer's name, ``(N, F)`` masks of the features ``_apply_`` prunes) for N batches
        ``inputs`` ``(N, B, ...)`` that all train with ``model``'s current weights (FedSGD clients of one
        round), from one representation and one vector-Jacobian product per feature for all N*B samples.

        Row i is what ``_apply_`` prunes for batch i alone whenever the model does not couple the samples
        of a batch: the gradient of feature f summed over all N*B samples, restricted to sample b, is then
        sample b's own (``feature_input_grad_norms``), and the scores and the mask are computed per batch
        with the same functions (``soteria_scores``, ``prune_count``, ``smallest_k_mask``). A model with
        BatchNorm in train mode couples them (batch statistics): refused (ValueError); apply the defense
        batch by batch there."""
        name, layer = self.find_layer(model)
        module = unwrap(model)
        if any(isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training for m in module.modules()):
            raise ValueError("soteria.column_masks: BatchNorm in train mode couples the samples of a batch; apply per batch")
        n, b = inputs.shape[:2]
        x = inputs.reshape(n * b, *inputs.shape[2:])
        r, norms = self._representation(model, name, layer, x)
        r = r.detach()
        k = prune_count(self.config.prune, r.shape[1])
        masks = torch.stack([smallest_k_mask(soteria_scores(norms[:, i * b : (i + 1) * b], r[i * b : (i + 1) * b]), k)
                             for i in range(n)])
        return name, masks
