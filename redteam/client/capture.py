"""Watch the user's own client code train, without touching it: which inputs its model trained on, with
which labels, in how many local steps.

The red team certifies code it did not write (a Flower ``ClientApp``, a ``train_fn``). To measure what
an attack recovers it needs the ground truth: the private samples the client actually trained on. It
records them through PyTorch's public extension points, active only inside ``TrainingCapture``:

- global module forward hooks (``torch.nn.modules.module.register_module_forward_pre_hook``): the input
  of every outermost forward of a module with parameters, in train mode with gradients enabled, is one
  local training step;
- a ``TorchFunctionMode``: the ``target`` of every ``F.cross_entropy`` / ``F.nll_loss`` call
  (``nn.CrossEntropyLoss`` and ``nn.NLLLoss`` call these) is that step's labels.

Nothing in the client changes; a client whose loss is something else yields steps without labels, which
the caller reports as an error rather than certifying blind.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules import module as module_hooks
from torch.overrides import TorchFunctionMode

_LOSSES = (F.cross_entropy, F.nll_loss)


@dataclass
class Step:
    """One local training step: the model's input batch and (once the loss ran) its labels."""

    model_id: int
    inputs: Tensor
    labels: Tensor | None = None


@dataclass
class Captured:
    steps: list[Step] = field(default_factory=list)
    unlabelled_losses: int = 0  # loss calls that came before any training forward

    def for_model(self, model_id: int | None = None) -> list[Step]:
        """The steps of one model (the one that trained most, when not given)."""
        if not self.steps:
            return []
        if model_id is None:
            ids = [s.model_id for s in self.steps]
            model_id = max(set(ids), key=ids.count)
        return [s for s in self.steps if s.model_id == model_id]


class _LossLabels(TorchFunctionMode):
    def __init__(self, captured: Captured) -> None:
        super().__init__()
        self.captured = captured

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _LOSSES:
            target = args[1] if len(args) > 1 else kwargs.get("target")
            if isinstance(target, Tensor):
                if self.captured.steps and self.captured.steps[-1].labels is None:
                    self.captured.steps[-1].labels = target.detach().clone()
                else:
                    self.captured.unlabelled_losses += 1
        return func(*args, **kwargs)


class TrainingCapture:
    """Context manager recording the training steps of any model run inside it (see the module docstring)."""

    def __init__(self) -> None:
        self.captured = Captured()
        self._depth = 0
        self._handles: list = []
        self._mode: _LossLabels | None = None

    def _pre(self, module: nn.Module, args) -> None:
        outermost = self._depth == 0
        self._depth += 1
        if not (outermost and module.training and torch.is_grad_enabled()):
            return
        if not args or not isinstance(args[0], Tensor) or not args[0].is_floating_point() or args[0].dim() < 2:
            return
        if next(module.parameters(), None) is None:  # a loss module, an activation: not the model
            return
        self.captured.steps.append(Step(model_id=id(module), inputs=args[0].detach().clone()))

    def _post(self, module: nn.Module, args, output) -> None:
        self._depth = max(0, self._depth - 1)

    def __enter__(self) -> "TrainingCapture":
        self._handles = [
            module_hooks.register_module_forward_pre_hook(self._pre),
            module_hooks.register_module_forward_hook(self._post, always_call=True),
        ]
        self._mode = _LossLabels(self.captured)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        for h in self._handles:
            h.remove()
        self._handles = []
