"""Check a received global model for the signatures of malicious-server attacks before training on it.

A malicious server does not only listen: it changes the model it sends so that the client's update
reveals its data. ``inspect_model`` looks for the published constructions (Wang et al. 2024, Sec. VII):

- **architecture** (any inserted module): the received parameters differ in names or shapes from the
  architecture the client expects (``reference``). Robbing the Fed's imprint block shows up here.
- **imprint** (Robbing the Fed, Fowl et al. 2022): a linear layer of 8+ rows that is (near) rank one -
  every row a multiple of one measurement vector - usually with biases that are a monotone sequence of
  thresholds (the bins, quantiles of the measurement), or with many identical rows.
- **class fishing** (Wen et al. 2022): the classification layer (the last linear layer) with most rows
  zeroed, or biases that pin some logits tens of units above others: only the target class's samples
  then send a gradient into the rest of the model.
- **gradient concentration** (fishing and other parameter edits), only with ``batch=(x, y)``, the
  client's own first batch: the model is run in eval mode without autograd; a model whose loss gradient
  into the classifier's input comes almost entirely from one sample or from the samples of one rare
  label is flagged. Output collapse (every sample put in one class) is measured and reported in
  ``checks`` but is no reason: DLG's wide initialisation produces it on its own.

Each check is a small pure function over tensors with its threshold as a module constant; the
docstrings say why. The thresholds were chosen from measurements on benign models (PyTorch default
initialisations, DLG's wide initialisation, checkpoints trained on CIFAR-10, FedAvg averages; see
``bench/bench_inspect.py``): the benign values are orders of magnitude from the attacks' values.

What it does not do: it cannot prove a model benign (an attacker who knows these checks can look for
constructions that avoid them), and it compares the received parameters with ``reference`` by name and
shape only, not by value.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
from torch import Tensor, nn

from guardfl.errors import ConfigError, MaliciousModelError

#: a linear layer needs at least this many rows (bins) for the imprint check: Robbing the Fed uses
#: hundreds of bins; rank one in a handful of rows is not an imprint of a batch
IMPRINT_MIN_ROWS = 8
#: second / first singular value below which a linear layer counts as rank one. An imprint layer is
#: exactly rank one (ratio ~1e-7 in float32); benign layers measured >= 0.18 (default and wide inits,
#: trained, FedAvg averages: their rows are independent draws or learned features)
RANK_ONE_RATIO = 1e-3
#: share of consecutive threshold steps (-bias / row scale, in row order) that go the same way for the
#: biases to count as a monotone (quantile) sequence; reported with an imprint, not required for one
MONOTONE_SHARE = 0.9
#: a linear layer of 8+ rows with at least this share of its non-zero rows exactly equal to another
#: row is flagged (an imprint's repeated measurement; random or trained rows never repeat)
DUPLICATE_ROW_SHARE = 0.5
#: a classification row counts as zeroed when its norm is at most this fraction of the largest row's
#: (class fishing sets rows to exactly 0; benign rows measured within a factor 3 of each other)
ZERO_ROW_RELATIVE = 1e-3
#: the classification layer is flagged when at least this share of its rows is zeroed (class fishing
#: zeroes every row but the target's)
ZERO_ROW_SHARE = 0.5
#: the classification biases are flagged when the largest minus the smallest exceeds this many logits:
#: exp(20) ~ 5e8, so classes 20 logits below the others get no probability (class fishing: 1000);
#: benign biases measured within 2 logits of each other (worst 1.9, a trained LeNet)
BIAS_GAP_LOGITS = 20.0
#: output collapse (reported in ``checks``, never a reason on its own): every sample's most probable
#: class is the same one with at least this mean probability although the batch holds other labels.
#: Measured: DLG's wide initialisation of LeNet collapses like that by itself (2 of 20 seeds, mean top
#: probability up to 0.997), so a collapsed output is no evidence of an attack; the fishing models are
#: caught by their weights and by the gradient concentration instead
COLLAPSE_PROBABILITY = 0.99
#: gradient concentration: share of the loss gradient into the classifier's input (the sum over
#: samples of its per-sample norms) carried by one sample, or by the samples of one label that are at
#: most half the batch, above which the batch's update is one sample's or one class's. Class fishing
#: gives 1.0 (the other classes' logits are pinned, their samples send exactly 0); benign models
#: measured <= 0.16 for one sample and <= 0.53 for one label in batches of 32 (a LeNet that predicts
#: mostly one class), non-IID batches included
CONCENTRATION_SHARE = 0.99
#: a label is judged by the gradient concentration check only when its samples are at most this share
#: of the batch (on a non-IID client most of the gradient legitimately comes from its majority label)
CONCENTRATION_LABEL_FRACTION = 0.5
#: concentration is judged only on batches of at least this many samples and 2+ labels (in a batch of
#: 2 one sample carrying most of the gradient is ordinary)
CONCENTRATION_MIN_BATCH = 8


@dataclass(frozen=True)
class Inspection:
    """The verdict of ``inspect_model``: ``ok`` and one sentence per signature found."""

    ok: bool
    #: each reason names the check, the layer and the number that tripped it
    reasons: list[str] = field(default_factory=list)
    #: per check, the headline measurements (whether or not they tripped); checks that did not run
    #: (no reference, no batch) are absent
    checks: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return self.ok


# -- the checks: pure functions over tensors -----------------------------------------------------------
def architecture_mismatch(received: Mapping[str, tuple[int, ...]], expected: Mapping[str, tuple[int, ...]]) -> list[str]:
    """Names missing from ``received``, names it adds, and shapes that differ from ``expected``
    (name -> shape). An inserted module (an imprint block) adds names and usually shifts the others."""
    reasons = []
    extra = [k for k in received if k not in expected]
    missing = [k for k in expected if k not in received]
    changed = [k for k in received if k in expected and tuple(received[k]) != tuple(expected[k])]
    if extra:
        reasons.append(f"architecture: {len(extra)} parameter(s) the client does not expect "
                       f"({_some(f'{k} {list(received[k])}' for k in extra)})")
    if missing:
        reasons.append(f"architecture: {len(missing)} expected parameter(s) missing ({_some(missing)})")
    if changed:
        reasons.append(f"architecture: {len(changed)} parameter(s) with changed shapes "
                       f"({_some(f'{k} {list(received[k])} instead of {list(expected[k])}' for k in changed)})")
    return reasons


def rank_ratio(weight: Tensor) -> float:
    """Second over first singular value of a 2-D weight (0 for rank one, nan for an all-zero weight)."""
    s = torch.linalg.svdvals(weight.detach().float())
    if s.numel() < 2 or float(s[0]) == 0.0:
        return float("nan")
    return float(s[1] / s[0])


def threshold_monotone_share(weight: Tensor, bias: Tensor) -> float:
    """For a (near) rank-one weight, rows ``s_i * v``: the share of consecutive steps of the row
    thresholds ``-b_i / s_i`` (in row order) that go the majority's way (1.0: a monotone sequence, the
    imprint's bins)."""
    w = weight.detach().double()
    _, _, vh = torch.linalg.svd(w, full_matrices=False)
    scale = w @ vh[0]
    keep = scale.abs() > 1e-12 * scale.abs().max().clamp_min(1e-300)
    t = (-bias.detach().double()[keep] / scale[keep])
    if t.numel() < 3:
        return 0.0
    steps = torch.sign(t[1:] - t[:-1])
    up, down = int((steps > 0).sum()), int((steps < 0).sum())
    return max(up, down) / steps.numel()


def duplicate_row_share(weight: Tensor) -> float:
    """Share of the non-zero rows of ``weight`` that are exactly equal to another row."""
    w = weight.detach().reshape(weight.shape[0], -1)
    w = w[w.abs().amax(dim=1) > 0]
    if w.shape[0] < 2:
        return 0.0
    _, inverse, counts = torch.unique(w, dim=0, return_inverse=True, return_counts=True)
    return float((counts[inverse] > 1).double().mean())


def zero_row_share(weight: Tensor) -> float:
    """Share of the rows of ``weight`` whose norm is at most ``ZERO_ROW_RELATIVE`` of the largest row's
    (0 for an all-zero weight: nothing is singled out)."""
    norms = weight.detach().double().reshape(weight.shape[0], -1).norm(dim=1)
    top = float(norms.max()) if norms.numel() else 0.0
    if top == 0.0:
        return 0.0
    return float((norms <= ZERO_ROW_RELATIVE * top).double().mean())


def bias_gap(bias: Tensor) -> float:
    """Largest minus smallest bias (in logits, for a classification layer)."""
    b = bias.detach().double()
    return float(b.max() - b.min()) if b.numel() else 0.0


def output_collapse(probs: Tensor, labels: Tensor) -> tuple[float, int, bool]:
    """(mean probability of the batch's most predicted class, that class, whether every sample's
    argmax is that class although some sample has another label)."""
    top = probs.argmax(dim=1)
    cls = int(torch.mode(top).values)
    mean = float(probs[:, cls].mean())
    unanimous = bool((top == cls).all()) and bool((labels != cls).any())
    return mean, cls, unanimous


def gradient_shares(probs: Tensor, onehot: Tensor, weight: Tensor, labels: Tensor) -> tuple[float, int, float, int]:
    """The cross-entropy gradient into the classifier's input, ``(p_i - y_i) @ W`` per sample: the largest
    share of the sum of per-sample norms carried by one sample (and its index), and by the samples of
    one label among the labels that hold at most ``CONCENTRATION_LABEL_FRACTION`` of the batch (and that
    label; -1 when no label is that rare). Shares are 0 when the batch sends no gradient at all."""
    g = (probs.double() - onehot.double()) @ weight.detach().double()
    norms = g.norm(dim=1)
    total = float(norms.sum())
    if total == 0.0:
        return 0.0, 0, 0.0, -1
    i = int(norms.argmax())
    per_class = torch.zeros(onehot.shape[1], dtype=torch.float64).index_add_(0, labels, norms) / total
    count = torch.bincount(labels, minlength=onehot.shape[1]).double()
    rare = (count > 0) & (count <= CONCENTRATION_LABEL_FRACTION * labels.numel())
    if not bool(rare.any()):
        return float(norms[i]) / total, i, 0.0, -1
    c = int(torch.where(rare, per_class, torch.full_like(per_class, -1.0)).argmax())
    return float(norms[i]) / total, i, float(per_class[c]), c


# -- the entry point -------------------------------------------------------------------------------------
def inspect_model(
    received: nn.Module | Mapping[str, Tensor],
    reference: nn.Module | Mapping[str, Any] | None = None,
    *,
    batch: tuple[Tensor, Tensor] | None = None,
    strict: bool = False,
) -> Inspection:
    """Inspect a received global model for malicious-server signatures (see the module docstring).

    ``received``: the model (an ``nn.Module``) or its state dict (name -> tensor). ``reference``: what the
    client expects: its own model (``nn.Module``) or a state dict of expected tensors or shapes; without
    it the architecture is not compared. ``batch``: ``(x, y)``, the client's own first batch (class
    indices), for the output and gradient checks; it needs a module to run (``received``, or ``reference``
    with the received state loaded into a copy). The model is run in eval mode without autograd and its
    training flag restored. ``strict=True`` raises ``MaliciousModelError`` when the model is not ok.
    """
    state = _state_of(received, "received")
    expected = None if reference is None else _shapes_of(reference)
    reasons: list[str] = []
    checks: dict[str, dict[str, Any]] = {}

    if expected is not None:
        found = architecture_mismatch({k: tuple(v.shape) for k, v in state.items()}, expected)
        checks["architecture"] = {"matches": not found}
        reasons += found

    linears = _linear_layers(state)
    imprint_reasons, checks["imprint"] = _imprint(linears[:-1])
    reasons += imprint_reasons

    classifier = linears[-1] if linears else None
    if classifier is not None:
        fishing_reasons, checks["class_fishing"] = _class_fishing(*classifier)
        reasons += fishing_reasons

    if batch is not None:
        module = _runnable(received, reference, state, architecture_ok=not any(r.startswith("architecture") for r in reasons))
        if module is not None:
            batch_reasons, batch_checks = _batch_checks(module, batch)
            reasons += batch_reasons
            checks.update(batch_checks)
        else:
            checks["batch"] = {"skipped": "the received architecture differs from the reference"}

    result = Inspection(ok=not reasons, reasons=reasons, checks=checks)
    if strict and not result.ok:
        raise MaliciousModelError(result.reasons)
    return result


def _some(items, n: int = 3) -> str:
    items = list(items)
    return ", ".join(str(i) for i in items[:n]) + (f" and {len(items) - n} more" if len(items) > n else "")


def _state_of(obj: Any, name: str) -> dict[str, Tensor]:
    if isinstance(obj, nn.Module):
        return dict(obj.state_dict())
    if isinstance(obj, Mapping):
        bad = [k for k, v in obj.items() if not isinstance(v, Tensor)]
        if bad:
            raise ConfigError(f"{name}: a state dict maps names to tensors; {bad[0]!r} is a {type(obj[bad[0]]).__name__}")
        return dict(obj)
    raise ConfigError(f"{name}: expected an nn.Module or a state dict (name -> tensor), got {type(obj).__name__}")


def _shapes_of(reference: Any) -> dict[str, tuple[int, ...]]:
    if isinstance(reference, nn.Module):
        return {k: tuple(v.shape) for k, v in reference.state_dict().items()}
    if isinstance(reference, Mapping):
        shapes = {}
        for k, v in reference.items():
            if isinstance(v, Tensor):
                shapes[k] = tuple(v.shape)
            elif isinstance(v, (tuple, list, torch.Size)) and all(isinstance(d, int) for d in v):
                shapes[k] = tuple(v)
            else:
                raise ConfigError(f"reference: a state dict maps names to tensors or shapes; {k!r} is a {type(v).__name__}")
        return shapes
    raise ConfigError(f"reference: expected None, an nn.Module or a state dict (name -> tensor or shape), got {type(reference).__name__}")


def _linear_layers(state: Mapping[str, Tensor]) -> list[tuple[str, Tensor, Tensor | None]]:
    """(name, weight, bias) of every 2-D floating-point ``*weight`` in state-dict order (linear layers)."""
    out = []
    for k, v in state.items():
        if k.endswith("weight") and v.dim() == 2 and v.is_floating_point():
            b = state.get(k[: -len("weight")] + "bias")
            b = b if isinstance(b, Tensor) and b.dim() == 1 and b.shape[0] == v.shape[0] else None
            out.append((k.removesuffix(".weight"), v, b))
    return out


def _imprint(linears) -> tuple[list[str], dict[str, Any]]:
    reasons, min_ratio, max_dup = [], float("inf"), 0.0
    for name, w, b in linears:
        rows, cols = w.shape
        if rows < IMPRINT_MIN_ROWS:
            continue
        dup = duplicate_row_share(w)
        max_dup = max(max_dup, dup)
        ratio = rank_ratio(w) if cols >= 2 else float("nan")
        if ratio == ratio:
            min_ratio = min(min_ratio, ratio)
        if ratio == ratio and ratio < RANK_ONE_RATIO:
            text = (f"imprint: layer '{name}' ({rows} x {cols}) is rank one (second/first singular value "
                    f"{ratio:.1e} < {RANK_ONE_RATIO:g}): every row measures the input along one direction")
            if b is not None:
                share = threshold_monotone_share(w, b)
                if share >= MONOTONE_SHARE:
                    text += f", and its {rows} biases are a monotone sequence of thresholds ({share:.0%} of steps one way), Robbing the Fed's bins"
            reasons.append(text)
        elif dup >= DUPLICATE_ROW_SHARE:
            reasons.append(f"imprint: layer '{name}' ({rows} x {cols}) has {dup:.0%} of its rows identical to another row "
                           f"(>= {DUPLICATE_ROW_SHARE:.0%}): a repeated measurement vector")
    return reasons, {"min_rank_ratio": min_ratio if min_ratio != float("inf") else None, "max_duplicate_row_share": max_dup}


def _class_fishing(name: str, w: Tensor, b: Tensor | None) -> tuple[list[str], dict[str, Any]]:
    reasons = []
    rows = w.shape[0]
    zero = zero_row_share(w) if rows >= 2 else 0.0
    gap = bias_gap(b) if b is not None else 0.0
    if rows >= 2 and zero >= ZERO_ROW_SHARE:
        kept = rows - round(zero * rows)
        reasons.append(f"class fishing: classification layer '{name}' has {rows - kept} of {rows} rows zeroed "
                       f"({zero:.0%} >= {ZERO_ROW_SHARE:.0%}), only {kept} class(es) can send a gradient into the model")
    ratio = rank_ratio(w) if rows >= 3 and w.shape[1] >= 2 else float("nan")
    if not reasons and ratio == ratio and ratio < RANK_ONE_RATIO:
        reasons.append(f"class fishing: classification layer '{name}' ({rows} x {w.shape[1]}) is rank one (second/first singular "
                       f"value {ratio:.1e} < {RANK_ONE_RATIO:g}): every class reads one feature direction")
    if gap > BIAS_GAP_LOGITS:
        reasons.append(f"class fishing: classification layer '{name}' has biases {gap:.3g} logits apart (> {BIAS_GAP_LOGITS:g}): "
                       f"the logits of some classes are pinned above the others")
    return reasons, {"layer": name, "zero_row_share": zero, "rank_ratio": ratio, "bias_gap": gap}


def _runnable(received, reference, state, architecture_ok: bool) -> nn.Module | None:
    if isinstance(received, nn.Module):
        return received
    if not isinstance(reference, nn.Module):
        raise ConfigError("batch: needs a model to run: pass received as an nn.Module, or reference as the client's nn.Module")
    if not architecture_ok:
        return None
    module = copy.deepcopy(reference)
    module.load_state_dict(state)
    return module


def _batch_checks(module: nn.Module, batch) -> tuple[list[str], dict[str, dict[str, Any]]]:
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2 and all(isinstance(t, Tensor) for t in batch)):
        raise ConfigError("batch: expected (x, y), two tensors: the client's first batch and its class labels")
    x, y = batch
    if y.dim() != 1 or y.is_floating_point() or y.shape[0] != x.shape[0]:
        raise ConfigError(f"batch: y must hold one integer class label per sample (x has {x.shape[0]}, y has shape {list(y.shape)})")
    linear = [m for m in module.modules() if isinstance(m, nn.Linear)]
    if not linear:
        return [], {"batch": {"skipped": "the model has no nn.Linear classification layer"}}
    head = linear[-1]
    seen: dict[str, Tensor] = {}
    hook = head.register_forward_hook(lambda m, inp, out: seen.update(logits=out))
    was_training = module.training
    try:
        device = next((p.device for p in module.parameters()), torch.device("cpu"))
        module.eval()
        with torch.no_grad():
            module(x.to(device))
    finally:
        hook.remove()
        module.train(was_training)
    logits = seen["logits"].detach().double().cpu()
    classes = logits.shape[1]
    y = y.cpu()
    if int(y.min()) < 0 or int(y.max()) >= classes:
        raise ConfigError(f"batch: label {int(y.max()) if int(y.max()) >= classes else int(y.min())} is out of range for {classes} classes")
    probs = torch.softmax(logits, dim=1)
    onehot = torch.nn.functional.one_hot(y, classes).double()
    reasons = []

    mean, cls, unanimous = output_collapse(probs, y)
    checks = {"output_collapse": {"class": cls, "mean_probability": mean, "unanimous": unanimous,
                                  "collapsed": unanimous and mean >= COLLAPSE_PROBABILITY}}

    labels = int(y.unique().numel())
    sample_share, i, class_share, c = gradient_shares(probs, onehot, head.weight.detach().cpu(), y)
    checks["gradient_concentration"] = {"sample_share": sample_share, "sample": i, "class_share": class_share, "label": c,
                                        "judged": x.shape[0] >= CONCENTRATION_MIN_BATCH and labels >= 2}
    if x.shape[0] >= CONCENTRATION_MIN_BATCH and labels >= 2:
        if sample_share > CONCENTRATION_SHARE:
            reasons.append(f"gradient concentration: sample {i} of {x.shape[0]} carries {sample_share:.1%} of the gradient into "
                           f"the classification layer's input (> {CONCENTRATION_SHARE:.0%}): the update would be that one sample's")
        elif class_share > CONCENTRATION_SHARE:
            reasons.append(f"gradient concentration: the {int((y == c).sum())} sample(s) of label {c} carry {class_share:.1%} of the "
                           f"gradient into the classification layer's input (> {CONCENTRATION_SHARE:.0%}) of a batch of "
                           f"{x.shape[0]} with {labels} labels")
    return reasons, checks


__all__ = [
    "BIAS_GAP_LOGITS",
    "COLLAPSE_PROBABILITY",
    "CONCENTRATION_LABEL_FRACTION",
    "CONCENTRATION_MIN_BATCH",
    "CONCENTRATION_SHARE",
    "DUPLICATE_ROW_SHARE",
    "IMPRINT_MIN_ROWS",
    "Inspection",
    "MONOTONE_SHARE",
    "RANK_ONE_RATIO",
    "ZERO_ROW_RELATIVE",
    "ZERO_ROW_SHARE",
    "architecture_mismatch",
    "bias_gap",
    "duplicate_row_share",
    "gradient_shares",
    "inspect_model",
    "output_collapse",
    "rank_ratio",
    "threshold_monotone_share",
    "zero_row_share",
]
