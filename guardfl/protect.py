"""``guardfl.protect``: one entry point for every defense, shaped like Opacus ``make_private``.

    model, optimizer, loader = guardfl.protect(model, optimizer, loader, defense)

- gradient defenses (GradPrune, SignCompression, noise, Outpost): the optimizer is wrapped
  (``GuardedOptimizer``); model and loader are returned as they are;
- DP-SGD: Opacus ``PrivacyEngine.make_private`` (or ``make_private_with_epsilon``) with Poisson sampling;
  BatchNorm is replaced by GroupNorm first (``ModuleValidator.fix``). Gradient defenses stacked with it
  act INSIDE Opacus's ``DPOptimizer`` (on its ``original_optimizer``), after clipping and noise, so Opacus
  neither discards their edits nor loses its accounting. The returned optimizer reports ``epsilon(delta)``,
  cumulative over rounds when the caller passes back ``privacy_state()`` (``privacy_state=`` argument);
- input encodings (MixUp, InstaHide): the loader yields encoded images with soft labels; train with
  ``guardfl.soft_cross_entropy`` (or ``F.cross_entropy``, which accepts class probabilities).

Randomness: Opacus's DP noise and its Poisson sampling come from generators of the DP-SGD defense (OS
entropy unless ``seed`` is given; the sampling on its own stream). Opacus's sampler would otherwise draw from
torch's global generator, which a fresh process seeds with a constant and most training scripts seed
themselves: the batches would be predictable, and DP-SGD's amplification by subsampling assumes they are not.
A seed gives the same noise wherever it is used again: across FL rounds, derive one per round
(``guardfl.integrations.torch.round_defense(defense, r)``, which ``local_update`` with its ``ClientState``
does); a seeded DP-SGD given a ``privacy_state`` (a later round) that ``round_defense`` did not build is a
``ConfigError``.
"""

from __future__ import annotations

import copy
import pickle
import warnings
from typing import Any, Callable, Iterator, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.optim import Optimizer

from guardfl.defenses import Defense, Identity, Stack, from_config
from guardfl.defenses.base import make_generator
from guardfl.defenses.dpsgd import DPSGD
from guardfl.errors import ConfigError
from guardfl.optimizer import FiniteStepGuard, GuardedOptimizer, ProxyOptimizer


def soft_cross_entropy(logits: Tensor, targets: Tensor) -> Tensor:
    """Cross-entropy with soft labels (rows of ``targets``; they need not sum to 1), batch mean. Integer
    targets are hard labels; a sequence model's ``(N, L, V)`` logits with ``(N, L)`` integer targets (a
    causal LM's next tokens) give the mean over the tokens, positions with target -100 skipped (Hugging
    Face's convention); soft ``(N, L, V)`` targets likewise, an all-zero row marking a skipped position."""
    if not targets.is_floating_point():
        if logits.dim() == 3 and targets.dim() == 2 and logits.shape[:2] == targets.shape:
            return F.cross_entropy(logits.flatten(0, -2), targets.flatten(), ignore_index=-100)
        return F.cross_entropy(logits, targets)
    if targets.dim() == 1:
        return F.cross_entropy(logits, targets)
    if targets.dim() == 3:
        per = -(targets * F.log_softmax(logits, dim=-1)).sum(-1)
        used = (targets.sum(-1) > 0).to(per.dtype)
        return (per * used).sum() / used.sum().clamp(min=1)
    return -(targets * F.log_softmax(logits, dim=-1)).sum(-1).mean()


def split_stages(defense: Defense) -> tuple[list[Defense], list[Defense], list[Defense]]:
    """(dp, input encodings, gradient defenses) among the leaves of a defense or a (nested) stack, order kept."""
    leaves = defense.leaves()
    by = lambda stage: [m for m in leaves if m.stage == stage]  # noqa: E731
    return by("dp"), by("input"), by("gradient")


class EncodedLoader:
    """A data loader whose batches are encoded by an input defense (MixUp / InstaHide).

    A loader whose batches (or short last batch) are known to be too small for the encoding is refused
    here, before training (``check_loader``); every batch is checked again when encoded."""

    def __init__(self, loader, encoding: Defense, num_classes: int) -> None:
        try:
            first = loader.dataset[0][0]
        except Exception:  # noqa: BLE001  no indexable sample: every batch is checked in __iter__
            first = None
        if isinstance(first, Tensor):  # token ids are refused before any batch-size complaint
            _require_float_inputs(encoding, first)
        check = getattr(encoding, "check_loader", None)
        if check is not None:
            check(loader)
        self.loader = loader
        self.encoding = encoding
        self.num_classes = num_classes

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        for x, y in self.loader:
            _require_float_inputs(self.encoding, x)
            yield self.encoding.encode(x, y, self.num_classes)

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:  # dataset, batch_size, sampler... of the wrapped loader
        return getattr(self.loader, name)


def _require_float_inputs(encoding: Defense, x: Tensor) -> None:
    """Refuse integer inputs (token ids, class indices): a weighted mix of them is no input at all (the
    coefficients were cast to the inputs' integer dtype, so MixUp silently trained on token 0)."""
    if not x.is_floating_point():
        raise ConfigError(f"defense: {encoding.kind} mixes images (floating-point inputs); this loader yields {x.dtype} "
                          "inputs (token ids?), which cannot be mixed; for a text model use a gradient defense or dpsgd")


class PrivateOptimizer(ProxyOptimizer):
    """What ``protect`` returns with DP-SGD: proxies Opacus's ``DPOptimizer`` (its ``original_optimizer``),
    whose own inner optimizer is the ``GuardedOptimizer`` of the stacked gradient defenses, and reports
    cumulative epsilon."""

    def __init__(self, dp_optimizer: Optimizer, engine, delta: float, guarded: GuardedOptimizer | None) -> None:
        super().__init__(dp_optimizer)
        self.privacy_engine = engine
        self.delta = delta
        self.guarded = guarded

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        return self.original_optimizer.step(closure)

    def epsilon(self, delta: float | None = None) -> float:
        """Epsilon spent so far (all rounds whose ``privacy_state`` was passed back) at ``delta``."""
        return float(self.privacy_engine.accountant.get_epsilon(delta=self.delta if delta is None else delta))

    def privacy_state(self) -> dict:
        """The accountant's state: save it and pass it to the next round's ``protect(privacy_state=...)``."""
        return self.privacy_engine.accountant.state_dict()

    def new_round(self) -> None:
        if self.guarded is not None:
            self.guarded.new_round()

    @property
    def last_stats(self):
        return self.guarded.last_stats if self.guarded is not None else None

    def state_dict(self) -> dict:
        sd = dict(self.original_optimizer.state_dict())
        sd["guardfl_privacy"] = self.privacy_state()
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        privacy = state_dict.pop("guardfl_privacy", None)
        self.original_optimizer.load_state_dict(state_dict)
        if privacy is not None:
            self.privacy_engine.accountant.load_state_dict(privacy)


def dp_compatible(model: nn.Module) -> nn.Module:
    """``model`` made trainable by Opacus: BatchNorm -> GroupNorm (``ModuleValidator.fix``). Raises
    ConfigError naming the offending layers when something cannot be fixed."""
    from opacus.validators import ModuleValidator

    if not ModuleValidator.validate(model, strict=False):
        return model
    try:
        fixed = ModuleValidator.fix(model)  # copies the model with torch.save first
    except (AttributeError, TypeError, pickle.PicklingError) as err:
        if "pickle" not in str(err):
            raise
        raise ConfigError(f"dpsgd: Opacus must replace layers of this model (BatchNorm, nn.MultiheadAttention) and copies it "
                          f"by pickling, which failed ({str(err).splitlines()[0]}); define its classes at module level, or "
                          "replace those layers yourself") from None
    errors = ModuleValidator.validate(fixed, strict=False)
    if errors:
        raise ConfigError("dpsgd: Opacus cannot train this model: " + "; ".join(str(e) for e in errors))
    return fixed


def _replaced(model: nn.Module, fixed: nn.Module) -> str:
    """What ``ModuleValidator.fix`` swapped, in words: "BatchNorm2d -> GroupNorm", "MultiheadAttention ->
    DPMultiheadAttention" (whose parameters are qlinear / klinear / vlinear), the outermost swapped modules."""
    fixed_modules, swapped, swaps = dict(fixed.named_modules()), [], set()
    for name, module in model.named_modules():
        if any(p == "" or name.startswith(p + ".") for p in swapped):
            continue
        new = fixed_modules.get(name)
        if type(new) is not type(module):
            swapped.append(name)
            swaps.add(f"{type(module).__name__} -> {type(new).__name__}")
    return ", ".join(sorted(swaps)) or "layers fixed"


def plain_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The model's state dict without Opacus's ``_module.`` prefix (keys an FL framework expects)."""
    return {k.removeprefix("_module."): v for k, v in model.state_dict().items()}


def load_plain_state_dict(model: nn.Module, state: Mapping[str, Tensor]) -> None:
    """Load unprefixed keys into a model that Opacus may have wrapped (``GradSampleModule``).

    Args:
        model: the model, wrapped by Opacus or not.
        state: a state dict with the plain module's keys (no ``_module.`` prefix)."""
    target = getattr(model, "_module", model)
    target.load_state_dict(dict(state))


def _rebuild_optimizer(optimizer: Optimizer, model: nn.Module) -> Optimizer:
    if len(optimizer.param_groups) != 1:
        raise ConfigError("dpsgd: the model had to be fixed for Opacus (BatchNorm -> GroupNorm, nn.MultiheadAttention -> "
                          "DPMultiheadAttention) and the optimizer has "
                          "several param groups; fix the model first with guardfl.dp_compatible(model)")
    group = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
    return type(optimizer)(model.parameters(), **group)


def _num_classes(model: nn.Module) -> int:
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise ConfigError("input encodings need num_classes= (no final nn.Linear to read it from)")
    return linears[-1].out_features


def protect(
    model: nn.Module,
    optimizer: Optimizer,
    data_loader,
    defense: Defense | Mapping[str, Any] | str,
    *,
    num_classes: int | None = None,
    privacy_state: dict | None = None,
) -> tuple[nn.Module, Optimizer, Any]:
    """Apply ``defense`` (any guardfl defense or stack) to a client's training; see the module docstring.

    ``model``, ``optimizer``, ``data_loader``: the client's, as Opacus's ``make_private`` takes them; the
    three returned replace them (DP-SGD: Opacus's wrapped model, a ``PrivateOptimizer`` and its Poisson
    loader; an input encoding: a loader of encoded batches with soft labels; a gradient defense: the
    optimizer wrapped by ``guardfl.wrap``). ``defense``: a ``Defense``, a config dict, a kind or a YAML path.
    ``num_classes``: the classes of the soft labels an encoding makes (default: inferred from the loader).
    ``privacy_state``: the accountant state of the previous rounds (``optimizer.privacy_state()``), so that
    epsilon is cumulative across FL rounds.

    >>> import torch, guardfl
    >>> from torch.utils.data import DataLoader, TensorDataset
    >>> from guardfl.defenses import DPSGD
    >>> model = torch.nn.Linear(4, 2)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> loader = DataLoader(TensorDataset(torch.rand(16, 4), torch.randint(0, 2, (16,))), batch_size=4)
    >>> model, opt, loader = guardfl.protect(model, opt, loader, DPSGD(noise_multiplier=1.0))
    >>> for x, y in loader:
    ...     opt.zero_grad(); torch.nn.functional.cross_entropy(model(x), y).backward(); opt.step()
    >>> opt.epsilon(1e-5) > 0
    True
    """
    defense = defense if isinstance(defense, Defense) else from_config(defense)
    dp, encodings, gradient = split_stages(defense)
    if len(dp) > 1:
        raise ConfigError("defense: at most one dpsgd stage in a stack")
    if len(encodings) > 1:
        raise ConfigError("defense: at most one input encoding (mixup / instahide) in a stack")
    grad_defense: Defense | None
    if not gradient:
        grad_defense = None
    elif len(gradient) == 1:
        grad_defense = gradient[0]
    else:
        grad_defense = Stack.regroup(gradient)  # the same instances, their own streams kept

    if dp and privacy_state is not None and defense.round_index is None and dp[0].stream_seed is not None:
        raise ConfigError("defense.seed: a seeded dpsgd with privacy_state (a later round) would draw the seed's first "
                          "noise again, which a server cancels by differencing two rounds; build each round's defense "
                          "with guardfl.integrations.torch.round_defense(defense, round) or use local_update with its "
                          "ClientState (per-round seeds), or leave seed unset (OS entropy)")
    if dp:
        model, dp_opt, engine, data_loader, guarded = _make_private(model, optimizer, data_loader, dp[0], grad_defense, privacy_state)
        optimizer = PrivateOptimizer(dp_opt, engine, dp[0].config.delta, guarded)
    else:
        if privacy_state is not None:
            raise ConfigError("privacy_state: given, but the defense has no dpsgd stage")
        optimizer = GuardedOptimizer(optimizer, grad_defense or Identity(), param_names=list(model.named_parameters()), model=model)
    if encodings:
        data_loader = EncodedLoader(data_loader, encodings[0], num_classes or _num_classes(model))
    return model, optimizer, data_loader


def _grad_sample_mode(model: nn.Module, data_loader) -> str:
    """Opacus's per-sample gradient mode for ``model``: "hooks" (its default), unless the model modifies a
    layer's output in place, which Opacus's full backward hooks forbid (torchvision's ResNet blocks do
    ``out += identity`` on a normalisation layer's output: "Output 0 of BackwardHookFunction is a view and
    is being modified inplace"); then "ew" (PyTorch's expanded weights: the same per-sample gradients,
    computed without hooks). Decided by one forward and backward of one training sample on a copy, once
    per module structure (the classes of its modules, whose code decides it): a red team or an FL loop
    protects the same model every round."""
    from opacus import GradSampleModule

    structure = tuple(type(m) for m in model.modules())
    if structure in _GRAD_SAMPLE_MODES:
        return _GRAD_SAMPLE_MODES[structure]
    try:
        x = data_loader.dataset[0][0]
    except Exception:  # noqa: BLE001  no indexable sample: keep Opacus's default
        return "hooks"
    probe = GradSampleModule(copy.deepcopy(model))
    mode = "hooks"
    try:
        probe(torch.as_tensor(x)[None].to(next(model.parameters()).device)).float().sum().backward()
    except RuntimeError as err:
        if "modified inplace" not in str(err):
            raise
        mode = "ew"
    finally:
        probe._close()
    _GRAD_SAMPLE_MODES[structure] = mode
    return mode


#: ``_grad_sample_mode``'s decisions by module structure
_GRAD_SAMPLE_MODES: dict[tuple[type, ...], str] = {}


#: the offset of DP-SGD's Poisson-sampling stream from its noise stream (``make_generator``)
SAMPLING_STREAM = 101


def _make_private(model, optimizer, data_loader, dp: DPSGD, grad_defense, privacy_state):
    from opacus import PrivacyEngine

    c = dp.config
    fixed = dp_compatible(model)
    if fixed is not model:
        warnings.warn(f"dpsgd: layers replaced for Opacus ({_replaced(model, fixed)}): a new model, whose state-dict keys "
                      "may differ; the optimizer was rebuilt for the new parameters")
        optimizer = _rebuild_optimizer(optimizer, fixed)
        model = fixed
    model.train()
    engine = PrivacyEngine(accountant=c.accountant)
    if privacy_state is not None:
        engine.accountant.load_state_dict(privacy_state)
    device = next(model.parameters()).device
    noise = make_generator(device, dp.stream_seed)  # OS entropy: the full mt19937 state
    common = dict(module=model, optimizer=optimizer, data_loader=data_loader, max_grad_norm=c.max_grad_norm,
                  poisson_sampling=c.poisson_sampling, noise_generator=noise,
                  grad_sample_mode=_grad_sample_mode(model, data_loader))
    try:
        if c.target_epsilon is not None:
            model, dp_opt, data_loader = engine.make_private_with_epsilon(
                target_epsilon=c.target_epsilon, target_delta=c.delta, epochs=c.epochs, **common)
        else:
            model, dp_opt, data_loader = engine.make_private(noise_multiplier=c.noise_multiplier, **common)
    except (NotImplementedError, ValueError) as err:
        raise ConfigError(f"dpsgd: Opacus cannot make this model private: {err}") from None
    if c.poisson_sampling:
        # Outside secure_mode, Opacus's Poisson sampler draws from torch's global generator: fixed-seeded in a
        # fresh process (67280421310721) and seeded by most training scripts, so which samples form each batch
        # would be predictable, and amplification by subsampling assumes the sampling is secret. It draws from
        # the defense's own stream instead (OS entropy unless seeded), like the noise.
        data_loader.batch_sampler.generator = make_generator("cpu", dp.stream_seed, offset=SAMPLING_STREAM)
    guarded = None
    names = {p: n.removeprefix("_module.") for n, p in model.named_parameters()}
    if grad_defense is not None:
        guarded = GuardedOptimizer(dp_opt.original_optimizer, grad_defense, param_names=list(model.named_parameters()), model=model,
                                   upstream="dpsgd")
        dp_opt.original_optimizer = guarded  # defend after Opacus has clipped and noised
    else:  # no gradient defense: still refuse a non-finite privatised gradient before the weights move
        dp_opt.original_optimizer = FiniteStepGuard(dp_opt.original_optimizer, "dpsgd", names)
    return model, dp_opt, engine, data_loader, guarded

