"""``GuardedOptimizer``: an optimizer wrapper that defends every gradient before the inner step.

Proxy pattern of Opacus ``DPOptimizer``: it stays a ``torch.optim.Optimizer`` (LR schedulers accept it),
shares ``param_groups``, ``state`` and ``defaults`` with the wrapped optimizer, and keeps it as
``original_optimizer``. On ``step()`` each ``p.grad`` is replaced, in place, by the defended gradient and
then the inner optimizer steps, so the local model moves by the defended update: what leaves the client
(the FedSGD gradient, or the FedAvg model delta) is defended.

Defenses that need the model and the batch inputs (``needs_model``: Soteria, GradDefense) get them through
``model=``: a forward pre-hook on the model records the first positional input of its latest forward pass
run with grad enabled (detached, no copy), and ``step()`` hands model and inputs to the defense.

After the defense and before the inner step, every defended gradient is checked for NaN and inf entries:
a non-finite one raises ``NonFiniteGradientError`` naming the defense and the parameters, and the weights
are not updated (fail closed).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Mapping

import torch
from torch import Tensor
from torch.optim import Optimizer

from guardfl.defenses.base import Defense, StepContext
from guardfl.defenses.registry import from_config
from guardfl.errors import NonFiniteGradientError, UnsupportedOptimizerError
from guardfl.ops.finite import nonfinite_where
from guardfl.stats import StepStats

_STATE_KEY = "guardfl"


class ProxyOptimizer(Optimizer):
    """An ``Optimizer`` that shares ``param_groups``, ``state`` and ``defaults`` with the optimizer it
    wraps (``original_optimizer``), as Opacus ``DPOptimizer`` does, so LR schedulers keep working."""

    def __init__(self, optimizer: Optimizer) -> None:
        self.original_optimizer = optimizer

    @property
    def param_groups(self) -> list[dict]:  # type: ignore[override]
        return self.original_optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict]) -> None:
        self.original_optimizer.param_groups = value

    @property
    def state(self):  # type: ignore[override]
        return self.original_optimizer.state

    @state.setter
    def state(self, value) -> None:
        self.original_optimizer.state = value

    @property
    def defaults(self) -> dict:  # type: ignore[override]
        return self.original_optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict) -> None:
        self.original_optimizer.defaults = value

    def add_param_group(self, param_group: dict) -> None:
        self.original_optimizer.add_param_group(param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.original_optimizer.zero_grad(set_to_none=set_to_none)

    def __getstate__(self) -> dict:
        return self.__dict__

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)


def check_finite_gradients(grads: list[Tensor], names: list[str], source: str) -> None:
    """Fail closed before the inner optimizer steps: raise ``NonFiniteGradientError`` naming ``source``
    (the defense) and the tensors when a defended gradient holds NaN or inf entries."""
    where = nonfinite_where(grads, names)
    if where is not None:
        raise NonFiniteGradientError(
            f"{source}: the defended gradient has non-finite entries in {where}; the optimizer step is refused "
            "(the weights are unchanged)"
        )


class FiniteStepGuard(ProxyOptimizer):
    """Refuses the wrapped optimizer's step when a gradient holds NaN or inf entries, naming ``source``.

    ``guardfl.protect`` puts it inside Opacus's ``DPOptimizer`` when DP-SGD runs without gradient defenses
    (with them, ``GuardedOptimizer`` does the same check), so a non-finite privatised gradient never
    reaches the weights (an inf per-sample gradient turns into NaN in Opacus's clipping)."""

    def __init__(self, optimizer: Optimizer, source: str, param_names: Mapping[Tensor, str] | None = None) -> None:
        super().__init__(optimizer)
        self.source = source
        self._param_names = dict(param_names or {})

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        check_finite_gradients([p.grad for p in params], [self._param_names.get(p, f"param{i}")
                                                          for i, p in enumerate(params)], self.source)
        self.original_optimizer.step()
        return loss

    def state_dict(self) -> dict:
        return self.original_optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.original_optimizer.load_state_dict(state_dict)


class _InputRecorder:
    """Forward pre-hook: keeps the first positional input of the model's latest forward pass with grad
    enabled (a training forward; evaluation under ``torch.no_grad()`` is not recorded). Paused while the
    defense runs its own passes through the model. Holds no reference to the optimizer, so a deep copy
    of the model records into its own copy."""

    def __init__(self) -> None:
        self.inputs: Tensor | None = None
        self.paused = False

    def __call__(self, module: torch.nn.Module, args: tuple) -> None:
        if not self.paused and torch.is_grad_enabled() and args and isinstance(args[0], Tensor):
            self.inputs = args[0].detach()


class GuardedOptimizer(ProxyOptimizer):
    """Wraps ``optimizer`` so that ``step()`` applies ``defense`` to the gradients first.

    Attributes:
        original_optimizer: the wrapped optimizer.
        defense: the defense (a single one or a ``Stack``).
        iteration: local iteration within the current FL round (1-based after the first step).
        last_stats: ``StepStats`` of the last step (None before the first step).
        model: the model given as ``model=`` (None if none was given).

    ``model`` is required when a leaf of the defense needs the model (Soteria, GradDefense): the inputs of
    the model's latest forward pass with grad enabled are recorded and handed to the defense at ``step()``
    (with gradient accumulation over several forward passes, only the last one's inputs). ``upstream``
    names what produced the gradient before this defense (``guardfl.protect`` passes "dpsgd"), for error
    messages.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        defense: Defense | Mapping[str, Any] | str,
        *,
        param_names: Mapping[Tensor, str] | Iterable[tuple[str, Tensor]] | None = None,
        model: torch.nn.Module | None = None,
        upstream: str | None = None,
    ) -> None:
        if isinstance(optimizer, GuardedOptimizer):
            raise UnsupportedOptimizerError(
                "optimizer is already guarded; combine defenses with guardfl.defenses.Stack instead"
            )
        if not isinstance(optimizer, Optimizer):
            raise UnsupportedOptimizerError(f"optimizer: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(optimizer, torch.optim.LBFGS):
            raise UnsupportedOptimizerError(
                "optimizer: LBFGS re-evaluates gradients inside step(), where no defense can reach them; "
                "use a first-order optimizer (SGD, Adam, AdamW, ...)"
            )
        super().__init__(optimizer)
        self.defense = defense if isinstance(defense, Defense) else from_config(defense)
        if self.defense.stages != {"gradient"}:
            outside = sorted({leaf.kind for leaf in self.defense.leaves() if leaf.stage != "gradient"})
            raise UnsupportedOptimizerError(
                f"defense: {self.defense.kind} includes {', '.join(outside)} (DP-SGD or an input encoding), which act outside the optimizer "
                "step; use guardfl.protect(model, optimizer, loader, defense)"
            )
        self.iteration = 0
        self.last_stats: StepStats | None = None
        #: what produced the gradient before this defense (``upstream``; guardfl.protect: "dpsgd"), for messages
        self._upstream: str | None = upstream
        if param_names is None and model is not None:
            param_names = list(model.named_parameters())
        if param_names is not None and not isinstance(param_names, Mapping):
            param_names = {p: n for n, p in param_names}
        self._param_names = dict(param_names) if param_names is not None else {}
        self.model = model
        self._recorder: _InputRecorder | None = None
        self._hook = None
        needing = [leaf for leaf in self.defense.leaves() if leaf.needs_model]
        if needing and model is None:
            kinds = ", ".join(sorted({leaf.kind for leaf in needing}))
            raise UnsupportedOptimizerError(
                f"defense: {kinds} needs the model and its batch inputs: pass model= (guardfl.wrap(optimizer, defense, model=model))"
            )
        if needing:
            for leaf in needing:
                leaf.check_model(model)
            self._recorder = _InputRecorder()
            self._hook = model.register_forward_pre_hook(self._recorder)

    def __del__(self) -> None:
        hook = self.__dict__.get("_hook")
        if hook is not None:
            hook.remove()

    def state_dict(self) -> dict:
        """The wrapped optimizer's state dict plus this wrapper's round state under ``"guardfl"``."""
        sd = dict(self.original_optimizer.state_dict())
        sd[_STATE_KEY] = {"iteration": self.iteration, "defense": self.defense.config.model_dump(mode="json")}
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Accepts a guarded or a plain optimizer state dict."""
        state_dict = dict(state_dict)
        guard = state_dict.pop(_STATE_KEY, None)
        self.original_optimizer.load_state_dict(state_dict)
        if guard is not None:
            self.iteration = int(guard.get("iteration", 0))

    def __repr__(self) -> str:
        return f"GuardedOptimizer({self.defense!r}, {self.original_optimizer!r})"

    def epsilon(self, delta: float) -> float:
        """No DP accounting without DP-SGD: infinite epsilon (use ``guardfl.protect`` with ``DPSGD``)."""
        return math.inf

    # -- federated-learning round ---------------------------------------------------------------------
    def new_round(self) -> None:
        """Mark an FL round boundary: the local iteration counter (Outpost's i) restarts."""
        self.iteration = 0

    # -- the step -------------------------------------------------------------------------------------
    def defend_gradients(self) -> StepStats:
        """Count one local iteration and replace every ``p.grad`` by its defended value, in place.

        ``step()`` calls this; call it yourself only if you need the defended gradients without a step.
        """
        params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        for p in params:
            if p.grad.is_sparse:
                raise UnsupportedOptimizerError(f"{self._name(p, 0)}: sparse gradients are not supported")
        self.iteration += 1
        names = [self._name(p, i) for i, p in enumerate(params)]
        recorder = self._recorder
        inputs = recorder.inputs if recorder is not None else None
        ctx = StepContext(iteration=self.iteration, params=[p.detach() for p in params], names=names,
                          model=self.model, inputs=inputs)
        if recorder is not None:
            recorder.paused, recorder.inputs = True, None  # the defense's own passes are not a training batch
        try:
            stages = self.defense.apply_([p.grad for p in params], ctx)
        finally:
            if recorder is not None:
                recorder.paused = False
        # The last line before the weights move, whatever the defense's own checks recorded (one reduction per
        # tensor), and it also sees an edit made through ``.data``, which has a version counter of its own.
        # Except for tensors a defense proved finite by a reduction over its final output, when that defense's
        # own class declares it (``verifies_output``: SignCompression; no subclass, stack or caller code runs
        # between that reduction and this line) and the tensor is unchanged since (issue 66: the second scan
        # of every gradient was much of sign compression's cost)
        grads = [p.grad for p in params]
        trusted = type(self.defense).__dict__.get("verifies_output", False)
        todo = [i for i, g in enumerate(grads) if not (trusted and ctx.output_verified(g))]
        if todo:
            check_finite_gradients([grads[i] for i in todo], [names[i] for i in todo], self._source())
        self.last_stats = StepStats(self.iteration, stages)
        return self.last_stats

    def _source(self) -> str:
        """What produced the gradient this wrapper hands to the inner step, for error messages: the
        defense's kind and, for a stack, its leaves (``guardfl.protect`` prefixes ``dpsgd`` under DP-SGD)."""
        kind = self.defense.kind
        if len(self.defense.leaves()) > 1 or self.defense.leaves()[0] is not self.defense:
            kind += f" ({', '.join(leaf.kind for leaf in self.defense.leaves())})"
        return f"{self._upstream}, then {kind}" if self._upstream else kind

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.defend_gradients()
        self.original_optimizer.step()
        return loss

    def _name(self, p: Tensor, i: int) -> str:
        return self._param_names.get(p, f"param{i}")


def wrap(
    optimizer: Optimizer,
    defense: Defense | Mapping[str, Any] | str,
    *,
    model: torch.nn.Module | None = None,
) -> GuardedOptimizer:
    """Guard ``optimizer`` with ``defense`` (a Defense, or a config dict / YAML for ``from_config``).

    Pass ``model`` to have ``last_stats`` name layers by their parameter names; defenses that need the
    model and the batch inputs (Soteria, GradDefense) require it.

    A defense instance keeps drawing from its streams across steps and calls. A defense built again with
    the same explicit ``seed`` starts the same streams again: in an FL loop that wraps a new optimizer
    every round, give each round its own (``guardfl.integrations.torch.round_defense(defense, round)``),
    or a server differencing two rounds' updates of one batch cancels the noise (``wrap`` has no round
    counter to check this; ``local_update`` has, and refuses a seeded defense without its ``ClientState``).

    >>> import torch, guardfl
    >>> model = torch.nn.Linear(4, 2)
    >>> opt = guardfl.wrap(torch.optim.SGD(model.parameters(), lr=0.1), {"kind": "gradprune", "ratio": 0.5}, model=model)
    >>> torch.nn.functional.cross_entropy(model(torch.rand(3, 4)), torch.tensor([0, 1, 0])).backward()
    >>> opt.step()
    >>> opt.last_stats.fired
    True
    """
    names = list(model.named_parameters()) if model is not None else None
    return GuardedOptimizer(optimizer, defense, param_names=names, model=model)
