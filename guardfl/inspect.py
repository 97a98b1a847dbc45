"""Check a received global model for the signatures of malicious-server attacks before training on it.

A malicious server does not only listen: it changes the model it sends so that the client's update
reveals its data. ``inspect_model`` looks for the published constructions (Wang et al. 2024, Sec. VII):

- **architecture** (any inserted module): the received parameters differ in names or shapes from the
  architecture the client expects (``reference``). Robbing the Fed's imprint block shows up here.
- **imprint** (Robbing the Fed, Fowl et al. 2022): a linear layer of 8+ rows that is (near) rank one -
  every row a multiple of one measurement vector - usually with biases that are a monotone sequence of
  thresholds (the bins, quantiles of the measurement), or with many identical rows.
- **parallel rows** (trap weights: the bins written into the honest model's own layer, ``guardfl.inspect_rows``):
  a hidden layer (every 2-D weight but the classifier, of ``PARALLEL_MIN_COLS`` or more inputs) with two
  non-zero rows that are near multiples of each other (``|cos| >= PARALLEL_COS``): one measurement direction
  repeated, which a layer kept full rank with no two rows equal still shows. Benign hidden layers measured
  <= 0.475. A server that adds to each row a part the inputs do not see passes it (the red team's
  ``trap_weights disguise``), as does a trap of single rows, each its own measurement.
- **class fishing** (Wen et al. 2022): the classification layer (the last linear layer) with most rows
  zeroed, or biases that pin some logits tens of units above others: only the target class's samples
  then send a gradient into the rest of the model.
- **gradient concentration** (fishing and other parameter edits), only with ``batch=(x, y)``, the
  client's own first batch: the model is run on it as the client trains it (``_training_forward``:
  BatchNorm on the batch's statistics, dropout off) and the summed cross-entropy is
  differentiated with respect to every ``nn.Linear`` layer's output (never into the parameters' ``.grad``);
  a model whose loss gradient into the classifier's input, or into any linear layer's weights, comes almost
  entirely from one sample or from the samples of one rare label is flagged. Output collapse (every sample
  put in one class) is measured and reported in ``checks`` but is no reason: DLG's wide initialisation
  produces it on its own.
- **isolation** (what the model does to the batch, not a fingerprint of its weights), with ``batch``
  (``guardfl.inspect_isolation``): the samples a server reads from one linear layer's weight gradient, by
  one row, the difference of two rows (coefficients that cancel, or a read within 25% of the input), a
  combination of two nested groups of rows of one support each (``guardfl.inspect_groups``: bins of several
  rows with their own classifier columns, which no pair of rows reads), and peeling, judged (by pairs
  alone, and with the groups) against what the client's architecture isolates at a fresh initialisation
  of its own on the same batch: on centred inputs benign models isolate none, and 2 samples and 5% of the batch are
  flagged; on uncentred inputs the honest architecture leaks much of the batch by itself and only an
  excess beyond chance is (``isolation_limit``). Robbing the Fed's bins, inside an
  inserted block or inside the honest model's own first layer (trap weights with scaled, shuffled rows
  and two measurement chains, which pass every weight check above), are flagged; a few trapped rows are
  not (the red team's ``trap_weights`` with ``rows`` runs exactly that, and a defense has to hold there).
  Behind a normalisation (``BatchNorm1d``, ``LayerNorm``, ``GroupNorm`` reading a linear layer's output),
  the gradient into the linear layer mixes the batch (BatchNorm's backward pass) or a sample's units, and
  hides every bin; the bins are in the gradient at the normalisation's OUTPUT, which is examined too (as
  layer ``'linear -> norm'``): a trap whose cut-offs sit in BatchNorm's affine parameters reads the
  samples up to two batch-wide terms (red team: ``trap_weights`` on ``fc2bn``).
- **shared columns** (with ``batch``; ``guardfl.inspect_columns``): every linear layer that reads hidden
  units, the loss's derivative with respect to each unit per sample (``delta @ W``); two units whose
  derivatives are parallel over the batch (``|cos| >= COLUMN_COS``) would give rows whose updates differ by
  the samples only one of them holds, as a trap chain's rows sharing one classifier column do. Compared on
  the batch, not the weights: columns that differ only where the batch's error does not look (softmax's
  all-ones direction, units that never fire) are caught. A chain whose columns carry a little noise
  passes at some cost to its exactness (the red team's ``trap_weights column_noise: auto``), as do single rows.
- **disaggregation** (opt-in, ``disaggregation=True``, with ``batch``): SEER's D-SNR (Garov et al. 2024):
  the model in train mode, each sample's own weight gradient, flagged when one sample's norm exceeds
  ``DSNR_THRESHOLD`` times the others' together (see docs/research/malicious-server.md for what it adds).
- **leak limit** (opt-in, ``leak_limit=k``, with ``batch``; ``leak_limit_check``): the isolation count of
  samples read exactly, over every linear layer but the classifier, absolute: more than ``k`` and the model
  is refused, the honest one too (the isolation check judges an excess over the client's own architecture,
  so it passes that architecture's own leak). Fails closed where the count is no bound (a normalisation
  of a linear layer's output, a layer too large to examine, a model it cannot run on); partial reads are
  not counted (docs/research/malicious-server.md section 15). One update's count is no bound against a server that
  may query one batch repeatedly: with every unit lifted to fire for every sample no support isolates
  anyone, and the classifier bins the batch across queries (the red team's ``threshold_bins`` reads faces
  exactly through a limit of 0; section 17). With ``history`` (a ``LeakHistory``, ``guardfl.inspect_history``)
  the limit counts across rounds: this update's reads, its difference's with every earlier update of the
  same batch, where two views of those updates (an update, a difference of two) meet in one sample
  (``guardfl.inspect_meets``: bins of different directions that share a face), and what those gave away
  (no face exactly then, but partial reads remain; sections 18-19).
  Against that, defend the update (fresh noise per round).

Each check is a small pure function over tensors with its threshold as a module constant; the
docstrings say why. The thresholds were chosen from measurements on benign models (PyTorch default
initialisations, DLG's wide initialisation, checkpoints trained on CIFAR-10, FedAvg averages; see
``bench/bench_inspect.py``): the benign values are orders of magnitude from the attacks' values.

Broken and hostile input fails closed (see ``inspect_model``): non-finite or unexaminable tensors and a
forward pass with non-finite activations are reasons, bad arguments one ``ConfigError`` line, and the
work on huge layers is bounded (``MAX_TENSOR_ELEMENTS``, ``EXACT_SVD_COST``, ``CHUNK_ELEMENTS``).

What it does not do: it cannot prove a model benign (an attacker who knows these checks can look for
constructions that avoid them: ``guardfl redteam`` runs the ones we know, README "Checks against
constructions"), and it compares the received parameters with ``reference`` by name and shape only, not
by value. Convolutions are not examined for isolation (a convolution's weight gradient sums over
positions: no row holds one sample's input), nor are combinations of three or more rows.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
from torch import Tensor, nn

from guardfl import inspect_columns
from guardfl.errors import ConfigError, MaliciousModelError
from guardfl.inspect_groups import GROUP_MAX_PAIRS
from guardfl.inspect_history import LeakHistory
from guardfl.inspect_isolation import (ISOLATION_INIT_SEED, ISOLATION_MIN_SAMPLES, ISOLATION_PEEL,
                                       ISOLATION_READ_ERROR, ISOLATION_SHARE, ISOLATION_SPREAD, ISOLATION_TOLERANCE,
                                       isolated_samples, isolation_limit, isolation_threshold)
from guardfl.inspect_rows import (MAX_CANDIDATES, PARALLEL_COS, PARALLEL_MAX_ROWS, PARALLEL_MIN_COLS, SCREEN_MARGIN,
                                  parallel_rows)

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
#: disaggregation SNR (Garov et al. 2024, SEER, the client-side check their paper holds every prior
#: malicious-server attack to; their public code ``detectability/detectability.py``), only with ``batch`` and
#: ``disaggregation=True``: the model in TRAIN mode on the batch (as the client trains: batch-norm layers
#: normalise with the batch's own statistics), each sample's loss differentiated alone with respect to every
#: ``nn.Linear`` and ``nn.Conv2d`` weight; per layer ``max_n |g_n| / (sum of the other |g_n|)``, the largest
#: over layers. The SEER authors report D-SNR 8.7 to 79 for breaching's fishing (0.77 at the smallest
#: multiplier); SEER is built to stay at benign values. No threshold is published; this one is set from
#: ``bench/bench_inspect.py`` and docs/research/malicious-server.md: benign models measured <= 0.54 on batches of 32
#: (100 models: default, wide and trained inits, FedAvg rounds IID and non-IID; an IID and a non-IID batch)
#: and <= 0.79 on batches of 8 (trained for 5 epochs: a batch of 8 spreads its gradient over fewer
#: samples), so 2 keeps a margin of 2.5 at the smallest judged batch. It is an option, off by default (see ``inspect_model``): what it adds over the
#: gradient-concentration check is class fishing whose target label has one or two samples in the batch, a
#: matter of the batch's composition (at a batch of 64 it catches none of the disguised fishing models), at
#: the price of one backward pass per sample on models with batch norm
DSNR_THRESHOLD = 2.0
#: D-SNR is judged only on batches of at least this many samples (in a batch of 2, D-SNR ~ 1 is ordinary)
DSNR_MIN_BATCH = 8
#: sample isolation (with ``batch``; ``guardfl.inspect_isolation``): the samples a server reads from one
#: linear layer's weight gradient (one row, the difference of two, peeling), judged against what the
#: client's architecture isolates on the same batch at a fresh initialisation of its own
#: (``isolation_limit``)
#: the largest layer (output units) examined for isolation, as the parallel-rows check's
#: (``PARALLEL_MAX_ROWS``); larger layers are named as not examined in ``checks``. 4,096 until 2026-11-27;
#: at 8,192 the worst case measured, decoy rows in 5 levels below a 12-row chain (26.8 million nested
#: pairs, batch 64), takes 3.3 s and 0.45 GB (the pairs found and screened a block of rows at a time), and
#: an honest FC-2 with 8,192 units 6-13 s for the whole inspection (CIFAR-10, batches of 12 and 64)
ISOLATION_MAX_UNITS = 8192
#: the most elements one tensor may have for inspect_model to examine it (2**27 ~ 134M: VGG-16's first
#: fully connected layer has 103M, a 7B language model's output layer 131M). A larger tensor is refused
#: ("too large to examine") instead of examined: the finiteness scan and the float copies the checks make
#: would each need up to 1 GiB per such tensor, and a hostile checkpoint can hold a zero-stride
#: (expanded) tensor of any size in a few bytes
MAX_TENSOR_ELEMENTS = 2**27
#: a linear layer whose exact SVD would cost more than this (rows x cols x min(rows, cols), ~ flops: a
#: 1000 x 2048 classifier is below it, 4096 x 4096 above) gets a randomized estimate of its top singular
#: values instead (a fixed-seed range finder of 8 columns, 4 power iterations, float32). The estimated
#: second singular value is a lower bound of the true one, so a rank-one layer is never missed; benign
#: layers (measured >= 0.18) stay orders of magnitude above RANK_ONE_RATIO
EXACT_SVD_COST = 2**32
#: the checks read large layers this many elements at a time (rows in chunks), so that their float64
#: copies stay small (32 MiB)
CHUNK_ELEMENTS = 2**22
#: the checks ``inspect_model`` runs, by the ``Inspection.checks`` key each reports under (the batch checks with
#: ``batch``; the opt-in ``disaggregation`` is not listed): one list for whoever states what was examined
CHECKS = ("architecture", "imprint", "parallel_rows", "class_fishing", "gradient_concentration", "isolation",
          "shared_columns")
#: integer and bool weights are examined as float64 (a layer loaded from them computes with their values)
_INTEGER_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                   *(getattr(torch, f"uint{n}") for n in (16, 32, 64) if hasattr(torch, f"uint{n}")))


@dataclass(frozen=True)
class Inspection:
    """The verdict of ``inspect_model``: ``ok`` and one sentence per signature found."""

    ok: bool
    #: each reason names the check, the layer and the number that tripped it
    reasons: list[str] = field(default_factory=list)
    #: per check, the headline measurements (whether or not they tripped); checks not asked for (no
    #: reference, no batch) are absent, checks that could not be made are ``{"skipped": why}``;
    #: ``checks["tensors"]`` lists the non-finite tensors, those not examined and those cast to float64
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
    """Second over first singular value of a 2-D weight (0 for rank one, nan for an all-zero weight).
    Exact below ``EXACT_SVD_COST``, a randomized estimate (never above the true ratio) above it."""
    rows, cols = weight.shape
    if rows * cols * min(rows, cols) <= EXACT_SVD_COST:
        s = torch.linalg.svdvals(_unit(weight, torch.float32))
    else:
        s, _ = _sketch_svd(weight)
    if s.numel() < 2 or float(s[0]) == 0.0:
        return float("nan")
    return float(s[1] / s[0])


def _sketch_svd(weight: Tensor, q: int = 8, iters: int = 4) -> tuple[Tensor, Tensor]:
    """Randomized range finder (Halko et al. 2011): approximate top singular values and right singular
    vectors of a large 2-D weight from ``q`` fixed-seed random directions (the caller's RNG untouched)."""
    w = _unit(weight, torch.float32)
    q = min(q, *w.shape)
    g = torch.Generator(device=w.device).manual_seed(0)
    y = w @ torch.randn(w.shape[1], q, generator=g, device=w.device)
    for _ in range(iters):
        y = w @ (w.T @ torch.linalg.qr(y).Q)
    basis = torch.linalg.qr(y).Q
    _, s, vh = torch.linalg.svd(basis.T @ w, full_matrices=False)
    return s, vh


def _row_chunks(w: Tensor):
    step = max(1, CHUNK_ELEMENTS // max(1, w.shape[1]))
    for i in range(0, w.shape[0], step):
        yield w[i:i + step]


def _max_abs(w: Tensor) -> float:
    """The largest |entry| of a 2-D tensor (read in row chunks); 0.0 when it is empty or all zero."""
    return max((float(c.double().abs().max()) for c in _row_chunks(w.detach()) if c.numel()), default=0.0)


def _unit(weight: Tensor, dtype: torch.dtype = torch.float64) -> Tensor:
    """``weight`` (2-D) divided by its largest |entry|, as ``dtype``, built in row chunks. The checks are
    scale-free; this keeps float overflow (a float64 layer of 1e300 is inf in float32, 1e37 squared
    overflows an SVD) and underflow (rows of 1e-300 have norm 0) out of them."""
    w = weight.detach().reshape(weight.shape[0], -1)
    top = _max_abs(w) or 1.0
    if w.shape[0] == 0:
        return w.to(dtype)
    return torch.cat([(c.double() / top).to(dtype) for c in _row_chunks(w)])


def threshold_monotone_share(weight: Tensor, bias: Tensor) -> float:
    """For a (near) rank-one weight, rows ``s_i * v``: the share of consecutive steps of the row
    thresholds ``-b_i / s_i`` (in row order) that go the majority's way (1.0: a monotone sequence, the
    imprint's bins)."""
    rows, cols = weight.shape
    if rows * cols * min(rows, cols) <= EXACT_SVD_COST:
        w = _unit(weight)
        _, _, vh = torch.linalg.svd(w, full_matrices=False)
        scale = w @ vh[0]
    else:
        _, vh = _sketch_svd(weight)
        v, top = vh[0].double(), _max_abs(weight) or 1.0
        scale = torch.cat([(c.double() / top) @ v for c in _row_chunks(weight.detach())])
    keep = scale.abs() > 1e-12 * scale.abs().max().clamp_min(1e-300)
    b = bias.detach().double()
    b = b / (float(b.abs().max()) or 1.0) if b.numel() else b  # a positive scale keeps the thresholds' order
    t = (-b[keep] / scale[keep])
    if t.numel() < 3:
        return 0.0
    steps = torch.sign(t[1:] - t[:-1])
    up, down = int((steps > 0).sum()), int((steps < 0).sum())
    return max(up, down) / steps.numel()


def duplicate_row_share(weight: Tensor) -> float:
    """Share of the non-zero rows of ``weight`` that are exactly equal to another row. Layers of up to
    ``CHUNK_ELEMENTS`` are compared whole; larger ones by a fingerprint of each row (its first 32 entries
    and two fixed-seed float64 projections), read in chunks."""
    w = weight.detach().reshape(weight.shape[0], -1)
    if w.numel() <= CHUNK_ELEMENTS:
        w = w[w.abs().amax(dim=1) > 0] if w.shape[1] else w[:0]
        if w.shape[0] < 2:
            return 0.0
        _, inverse, counts = torch.unique(w, dim=0, return_inverse=True, return_counts=True)
        return float((counts[inverse] > 1).double().mean())
    g = torch.Generator().manual_seed(0)
    proj = torch.randn(w.shape[1], 2, generator=g, dtype=torch.float64).to(w.device)
    top = _max_abs(w) or 1.0
    nonzero, prints = [], []
    for c in _row_chunks(w):
        nonzero.append(c.abs().amax(dim=1) > 0)
        prints.append(torch.cat([c[:, :32].double(), (c.double() / top) @ proj], dim=1))
    keep = torch.cat(nonzero)
    prints = torch.cat(prints)[keep]
    if prints.shape[0] < 2:
        return 0.0
    _, inverse, counts = torch.unique(prints, dim=0, return_inverse=True, return_counts=True)
    return float((counts[inverse] > 1).double().mean())


def zero_row_share(weight: Tensor) -> float:
    """Share of the rows of ``weight`` whose norm is at most ``ZERO_ROW_RELATIVE`` of the largest row's
    (0 for an all-zero weight: nothing is singled out)."""
    w = weight.detach().reshape(weight.shape[0], -1)
    top = _max_abs(w) or 1.0
    norms = torch.cat([(c.double() / top).norm(dim=1) for c in _row_chunks(w)]) if w.shape[0] else torch.zeros(0, dtype=torch.float64)
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
    return concentration(g.norm(dim=1), labels, onehot.shape[1])


def disaggregation_snr(norms: Tensor) -> tuple[float, int]:
    """SEER's D-SNR of one layer (see ``DSNR_THRESHOLD``) from its per-sample gradient norms: the largest
    over the sum of the others, and that sample's index. (0.0, -1) when no sample sends a gradient; inf when
    exactly one does. (SEER's code adds 1e-6 to the denominator; here the ratio is exact.)"""
    n = norms.detach().double().flatten()
    if n.numel() == 0 or float(n.max()) <= 0.0:
        return 0.0, -1
    i = int(n.argmax())
    top = float(n[i])
    rest = float(torch.cat([n[:i], n[i + 1:]]).sum())  # summed apart: sum - max cancels when one dominates
    return (float("inf") if rest <= 1e-12 * top else top / rest), i


def per_sample_weight_norms(module: nn.Module, x: Tensor, y: Tensor) -> tuple[dict[str, Tensor], list[str]]:
    """SEER's per-sample gradient norms: for every ``nn.Linear`` and ``nn.Conv2d`` weight, each sample's
    ``|d loss_n / d W|`` with the model in TRAIN mode on the whole batch (as the client trains), on a deep
    copy (train mode updates batch-norm running statistics; the received module is untouched) and with the
    caller's random state restored (dropout). Returns the norms per weight name and the layers not examined.

    Two exact ways, the cheaper one the model allows:

    - no batch norm (no module that mixes the samples of a batch): the layer's gradient of the summed loss
      is ``sum_n delta_n a_n^T`` (over positions for a convolution: ``a_n`` the unfolded input patches,
      ``delta_n`` the gradient into the layer's output), and sample n's term is its own loss's gradient:
      one forward and one backward pass (Goodfellow's per-sample trick);
    - batch norm in train mode: one sample's loss depends on every sample (the batch's statistics), so each
      loss is differentiated alone (``is_grads_batched``, in chunks of samples whose gradients stay under
      ``CHUNK_ELEMENTS`` x 8 floats): one backward pass per sample (a ResNet-18 on 32 images: minutes on 2
      busy cores)."""
    model = copy.deepcopy(module)
    model.train()
    n = x.shape[0]
    names = {id(m): name for name, m in model.named_modules()}
    layers = [m for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv2d))]
    skipped: list[str] = []
    mixes = any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())
    if not mixes:
        usable = []
        for m in layers:
            if isinstance(m, nn.Conv2d) and (m.groups != 1 or m.padding_mode != "zeros" or isinstance(m.padding, str)):
                skipped.append(f"{names[id(m)]}.weight (groups {m.groups}, padding {m.padding!r} {m.padding_mode})")
            else:
                usable.append(m)
        layers = usable
    for m in layers:
        m.weight.requires_grad_(True)
    seen: list[tuple[str, nn.Module, Tensor, Tensor]] = []

    def hook(m, inp, out):
        if isinstance(out, Tensor) and out.requires_grad and inp and isinstance(inp[0], Tensor) and inp[0].shape[:1] == (n,):
            out.retain_grad()
            seen.append((names[id(m)], m, inp[0].detach(), out))

    hooks = [] if mixes else [m.register_forward_hook(hook) for m in layers]
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    norms: dict[str, Tensor] = {}
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.enable_grad():
            out = model(x.detach().to(device))
            if not (isinstance(out, Tensor) and out.dim() == 2 and out.shape[0] == n):
                raise ValueError(f"the model's output is not one row of logits per sample (shape [{n}, classes])")
            losses = torch.nn.functional.cross_entropy(out, y.to(device).long(), reduction="none")
            if mixes:
                return _per_loss_norms(losses, [(f"{names[id(m)]}.weight", m.weight) for m in layers]), skipped
            losses.sum().backward()
    finally:
        for h in hooks:
            h.remove()
    for name, m, a, o in seen:
        key = f"{name}.weight"
        if o.grad is None or key in norms:  # unused output, or a module applied twice (its terms mix): once
            if key in norms:
                skipped.append(f"{key} (applied more than once)")
                norms.pop(key)
            continue
        d = o.grad.detach()
        if isinstance(m, nn.Linear):
            if a.dim() == 2:
                norms[key] = (d.double().norm(dim=1) * a.double().norm(dim=1)).cpu()
            else:  # sequence inputs (n, ..., features): the per-sample gradient sums over positions
                a3, d3 = a.reshape(n, -1, a.shape[-1]), d.reshape(n, -1, d.shape[-1])
                norms[key] = torch.stack([(d3[i].T.double() @ a3[i].double()).norm() for i in range(n)]).cpu()
        else:
            cols = []
            step = max(1, CHUNK_ELEMENTS // max(1, a[0].numel() * m.kernel_size[0] * m.kernel_size[1]))
            for i in range(0, n, step):
                patches = torch.nn.functional.unfold(a[i:i + step], m.kernel_size, m.dilation, m.padding, m.stride)
                g = d[i:i + step].flatten(2) @ patches.transpose(1, 2)  # (chunk, out channels, in x k x k)
                cols.append(g.double().flatten(1).norm(dim=1).cpu())
            norms[key] = torch.cat(cols)
    return norms, skipped


def _per_loss_norms(losses: Tensor, weights: list[tuple[str, Tensor]]) -> dict[str, Tensor]:
    """``|d losses[n] / d W|`` for every sample n and weight W: one backward pass per sample, batched."""
    n = losses.shape[0]
    params = [w for _, w in weights]
    total = sum(p.numel() for p in params)
    chunk = max(1, min(n, (8 * CHUNK_ELEMENTS) // max(1, total)))
    norms = torch.zeros(len(params), n, dtype=torch.float64)
    eye = torch.eye(n, device=losses.device, dtype=losses.dtype)
    for start in range(0, n, chunk):
        rows = eye[start:start + chunk]
        try:
            grads = torch.autograd.grad(losses, params, grad_outputs=rows, retain_graph=True,
                                        is_grads_batched=True, allow_unused=True)
        except RuntimeError:  # an operation without a batching rule: one sample at a time
            grads = [None if g[0] is None else torch.stack(g) for g in zip(*(
                torch.autograd.grad(losses, params, grad_outputs=r, retain_graph=True, allow_unused=True) for r in rows))]
        for k, g in enumerate(grads):
            if g is not None:
                norms[k, start:start + rows.shape[0]] = g.detach().double().flatten(1).norm(dim=1).cpu()
    return {name: norms[k] for k, (name, _) in enumerate(weights)}


def concentration(norms: Tensor, labels: Tensor, classes: int) -> tuple[float, int, float, int]:
    """From per-sample gradient norms: the largest share of their sum carried by one sample (and its
    index), and by the samples of one label among the labels that hold at most
    ``CONCENTRATION_LABEL_FRACTION`` of the batch (and that label; -1 when no label is that rare). Shares
    are 0 when the batch sends no gradient at all."""
    norms = norms.double()
    total = float(norms.sum())
    if total == 0.0:
        return 0.0, 0, 0.0, -1
    i = int(norms.argmax())
    per_class = torch.zeros(classes, dtype=torch.float64).index_add_(0, labels, norms) / total
    count = torch.bincount(labels, minlength=classes).double()
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
    disaggregation: bool = False,
    leak_limit: int | None = None,
    history: LeakHistory | None = None,
) -> Inspection:
    """Inspect a received global model for malicious-server signatures (see the module docstring).

    ``received``: the model (an ``nn.Module``) or its state dict (name -> tensor). ``reference``: what the
    client expects: its own model (``nn.Module``) or a state dict of expected tensors or shapes; without
    it the architecture is not compared. ``batch``: ``(x, y)``, the client's own first batch (class
    indices), for the output and gradient checks; it needs a module to run (``received``, or ``reference``
    with the received state loaded into a copy). The model is run in eval mode (autograd for the gradient
    checks, which never touch the parameters' ``.grad``) and its training flag restored; with ``reference``
    a module, a fresh initialisation of its architecture (of the received module's without one) is run on the
    batch too, as the baseline of the isolation check. ``strict=True`` raises ``MaliciousModelError`` when the model is not ok.
    ``disaggregation=True`` (with ``batch``) adds SEER's D-SNR check (``DSNR_THRESHOLD``): a deep copy of the
    model in train mode, per-sample weight-gradient norms (one backward pass per sample when the model has
    batch norm: minutes for a ResNet-18 on 2 busy cores), reported in ``checks["disaggregation"]``.
    ``leak_limit=k`` (with ``batch``; ``leak_limit_check``) refuses any model, the honest one included,
    with which a server reads more than ``k`` samples of the batch from the update's linear layers (the
    isolation check's count, not judged against anything): an absolute limit, where the isolation check
    alone judges a model against the client's architecture at a fresh initialisation and so passes the
    honest model's own leak. Reported in ``checks["leak_limit"]``. ``history`` (a ``LeakHistory`` the client
    keeps for its whole life, with ``leak_limit``) extends the limit across rounds: the samples read from
    this update, from its difference with every update the client sent on the same batch, and those earlier
    rounds gave away, together (``guardfl.inspect_history``); an accepted model's round is added to it.

    Broken or hostile models fail closed: a model is **not ok** (a reason, or ``MaliciousModelError``
    with ``strict=True``) when a tensor holds NaN or infinite values ("non-finite:"), cannot be examined
    (meta device, sparse or complex, an unsupported dtype, more than ``MAX_TENSOR_ELEMENTS`` elements:
    "unusable:"), when the received state does not load into the reference, when the batch's forward
    pass gives NaN or infinite activations, or when the model has ``nn.Linear`` layers of which none ran
    on the batch. Integer and bool weight matrices are examined as float64 (``checks["tensors"]``
    lists them). A check that could not be made is named in ``checks`` (``{"skipped": why}``), never
    passed silently; the batch checks are skipped when the model is already refused for its tensors.

    Bad arguments raise ``ConfigError``, one line naming the argument: ``received`` / ``reference`` that
    are not a module or a state dict of tensors (or shapes), a ``reference`` module on the meta device
    with a batch to run, and a ``batch`` that is not ``(x, y)`` with one integer label per sample, is
    empty, has labels out of the classifier's range, or on which the model cannot run (wrong shape or
    dtype: the error's first line is quoted).

    Work is bounded: tensors above ``MAX_TENSOR_ELEMENTS`` are refused unexamined, linear layers above
    ``EXACT_SVD_COST`` get a randomized SVD estimate, and large layers are read in row chunks.
    """
    state = _state_of(received, "received")
    expected = None if reference is None else _shapes_of(reference)
    if leak_limit is not None:
        check_leak_limit(leak_limit, "leak_limit", "samples of the batch")
        if batch is None:
            raise ConfigError("leak_limit: needs batch, the client's own (x, y): the limit is on what a server reads of it")
    if history is not None:
        if not isinstance(history, LeakHistory):
            raise ConfigError(f"history: must be a guardfl.inspect_history.LeakHistory, got {type(history).__name__}")
        if leak_limit is None:
            raise ConfigError("history: extends the leak limit across rounds, but leak_limit is None: set leak_limit, or history=None")
    signals: dict[str, tuple[Tensor, Tensor]] = {}
    reasons: list[str] = []
    checks: dict[str, dict[str, Any]] = {}

    if expected is not None:
        found = architecture_mismatch({k: tuple(v.shape) for k, v in state.items()}, expected)
        checks["architecture"] = {"matches": not found}
        reasons += found

    tensor_reasons, skipped, checks["tensors"] = _examine_tensors(state)
    reasons += tensor_reasons

    linears = _linear_layers(state, skipped)  # refused tensors included, as (name, None, None): the classifier is the last
    hidden = [layer for layer in linears[:-1] if layer[1] is not None]
    imprint_reasons, checks["imprint"] = _imprint(hidden)
    reasons += imprint_reasons
    parallel_reasons, checks["parallel_rows"] = _parallel(hidden)
    reasons += parallel_reasons

    classifier = linears[-1] if linears else None
    if classifier is not None and classifier[1] is not None:
        fishing_reasons, checks["class_fishing"] = _class_fishing(*classifier)
        reasons += fishing_reasons
    else:
        checks["class_fishing"] = {"skipped": "no 2-D weight (linear layer) in the model" if classifier is None else
                                   f"the classification layer '{classifier[0]}' was refused unexamined (see reasons)"}
        classifier = None

    if batch is not None:
        _valid_batch(batch)
        if not isinstance(received, nn.Module) and not isinstance(reference, nn.Module):
            raise ConfigError("batch: needs a model to run: pass received as an nn.Module, or reference as the client's nn.Module")
        if tensor_reasons:
            checks["batch"] = {"skipped": "the model's tensors were refused (see reasons): it is not run"}
        else:
            architecture_ok = not any(r.startswith("architecture") for r in reasons)
            module, load_reason = _runnable(received, reference, state, architecture_ok=architecture_ok)
            if module is not None:
                # the isolation baseline is a fresh initialisation of the client's architecture: the reference's,
                # or the module the received state runs in (never anyone's weights)
                baseline = reference if isinstance(reference, nn.Module) else module
                batch_reasons, batch_checks = _batch_checks(module, batch, classifier[0] if classifier else None, baseline,
                                                            disaggregation, signals)
                reasons += batch_reasons
                checks.update(batch_checks)
                if leak_limit is not None:
                    limit_reasons, checks["leak_limit"] = leak_limit_check(checks.get("isolation"), len(batch[0]), leak_limit)
                    reasons += limit_reasons
                    if history is not None and "read" in checks["leak_limit"]:
                        reasons += _leak_history(history, batch, signals, checks["leak_limit"], leak_limit)
            else:
                checks["batch"] = {"skipped": load_reason or "the received architecture differs from the reference"}
                if load_reason:
                    reasons.append(load_reason)

    if leak_limit is not None and "leak_limit" not in checks:  # the model was refused before it could run
        checks["leak_limit"] = {"limit": leak_limit, "skipped": "the model did not run on the batch (see reasons)"}
    # names come from the sender: keep every reason on one line
    reasons = [r.replace("\r", "\\r").replace("\n", "\\n") for r in reasons]
    result = Inspection(ok=not reasons, reasons=reasons, checks=checks)
    if history is not None and result.ok:  # a refused model's update is never sent: only accepted rounds are remembered
        history.record(*_valid_batch(batch), signals, set(checks["leak_limit"].get("all_samples", [])))
    if strict and not result.ok:
        raise MaliciousModelError(result.reasons)
    return result


def _some(items, n: int = 3) -> str:
    items = list(items)
    return ", ".join(str(i) for i in items[:n]) + (f" and {len(items) - n} more" if len(items) > n else "")


def _first_line(err: BaseException, limit: int = 200) -> str:
    text = (str(err).strip().splitlines() or [""])[0]
    return f"{type(err).__name__}: {text[:limit]}{'...' if len(text) > limit else ''}"


def _state_of(obj: Any, name: str) -> dict[str, Tensor]:
    if isinstance(obj, nn.Module):
        state = dict(obj.state_dict())
        bad = [k for k, v in state.items() if not isinstance(v, Tensor)]
        if bad:
            raise ConfigError(f"{name}: the module's state dict holds non-tensor values ({bad[0]!r} is a "
                              f"{type(state[bad[0]]).__name__}); inspect_model examines tensors only")
        return state
    if isinstance(obj, Mapping):
        bad = [k for k in obj if not isinstance(k, str)]
        if bad:
            raise ConfigError(f"{name}: a state dict maps names (strings) to tensors; key {bad[0]!r} is a {type(bad[0]).__name__}")
        bad = [k for k, v in obj.items() if not isinstance(v, Tensor)]
        if bad:
            raise ConfigError(f"{name}: a state dict maps names to tensors; {bad[0]!r} is a {type(obj[bad[0]]).__name__}")
        return dict(obj)
    raise ConfigError(f"{name}: expected an nn.Module or a state dict (name -> tensor), got {type(obj).__name__}")


def _shapes_of(reference: Any) -> dict[str, tuple[int, ...]]:
    if isinstance(reference, nn.Module):
        return {k: tuple(v.shape) for k, v in reference.state_dict().items() if isinstance(v, Tensor)}
    if isinstance(reference, Mapping):
        shapes = {}
        for k, v in reference.items():
            if not isinstance(k, str):
                raise ConfigError(f"reference: a state dict maps names (strings) to tensors or shapes; key {k!r} is a {type(k).__name__}")
            if isinstance(v, Tensor):
                shapes[k] = tuple(v.shape)
            elif (isinstance(v, (tuple, list, torch.Size)) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in v)):
                shapes[k] = tuple(v)
            else:
                raise ConfigError(f"reference: a state dict maps names to tensors or shapes (tuples of ints >= 0); "
                                  f"{k!r} is a {type(v).__name__}")
        return shapes
    raise ConfigError(f"reference: expected None, an nn.Module or a state dict (name -> tensor or shape), got {type(reference).__name__}")


def _examine_tensors(state: Mapping[str, Tensor]) -> tuple[list[str], set[str], dict[str, Any]]:
    """Reasons for tensors that hold NaN / inf or cannot be examined, the names of those tensors (the
    weight checks leave them out: the model is refused anyway), and what was found."""
    unusable: dict[str, str] = {}
    non_finite: dict[str, str] = {}
    cast: list[str] = []
    for k, v in state.items():
        if v.is_meta:
            unusable[k] = "meta device, no values"
        elif v.layout != torch.strided:
            unusable[k] = f"{v.layout} layout"
        elif v.is_complex():
            unusable[k] = f"complex dtype {v.dtype}"
        elif not (v.is_floating_point() or v.dtype in _INTEGER_DTYPES):
            unusable[k] = f"unsupported dtype {v.dtype}"
        elif v.numel() > MAX_TENSOR_ELEMENTS:
            unusable[k] = f"{v.numel()} elements > {MAX_TENSOR_ELEMENTS}, too large to examine"
        elif v.is_floating_point():
            try:
                finite = torch.isfinite(v)
            except (RuntimeError, TypeError, NotImplementedError) as err:
                unusable[k] = f"dtype {v.dtype} cannot be scanned ({_first_line(err, 80)})"
                continue
            if not bool(finite.all()):
                nan = int(torch.isnan(v).sum())
                inf = int((~finite).sum()) - nan
                non_finite[k] = " and ".join(p for p in (f"{nan} NaN" if nan else "", f"{inf} inf" if inf else "") if p)
        elif v.dim() == 2 and k.endswith("weight"):
            cast.append(k)
    reasons = []
    if non_finite:
        reasons.append(f"non-finite: {len(non_finite)} tensor(s) hold NaN or infinite values "
                       f"({_some(f'{k} ({n})' for k, n in non_finite.items())}): the model cannot be trained on or examined")
    if unusable:
        reasons.append(f"unusable: {len(unusable)} tensor(s) cannot be examined "
                       f"({_some(f'{k} ({why})' for k, why in unusable.items())})")
    found = {"non_finite": list(non_finite), "not_examined": list(unusable), "examined_as_float64": cast}
    return reasons, set(non_finite) | set(unusable), found


def _linear_layers(state: Mapping[str, Tensor], skipped: set[str] = frozenset()) -> list[tuple[str, Tensor | None, Tensor | None]]:
    """(name, weight, bias) of every 2-D ``*weight`` in state-dict order (linear layers), floating-point or
    integer / bool (cast to float64); a weight in ``skipped`` (refused unexamined) is (name, None, None)."""
    out: list[tuple[str, Tensor | None, Tensor | None]] = []
    for k, v in state.items():
        if not (k.endswith("weight") and v.dim() == 2):
            continue
        if k in skipped or not (v.is_floating_point() or v.dtype in _INTEGER_DTYPES):
            out.append((k.removesuffix(".weight"), None, None))
            continue
        if not v.is_floating_point():
            v = v.double()
        bk = k[: -len("weight")] + "bias"
        b = state.get(bk) if bk not in skipped else None
        b = b if isinstance(b, Tensor) and b.dim() == 1 and b.shape[0] == v.shape[0] else None
        if b is not None and not b.is_floating_point():
            b = b.double() if b.dtype in _INTEGER_DTYPES else None
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


def _parallel(linears) -> tuple[list[str], dict[str, Any]]:
    """The near-parallel-rows check (``guardfl.inspect_rows``) on the hidden layers."""
    reasons, layers, not_examined, worst = [], {}, [], 0.0
    for name, w, _ in linears:
        rows, cols = w.shape
        if cols < PARALLEL_MIN_COLS or rows < 2:
            continue
        if rows > PARALLEL_MAX_ROWS:
            not_examined.append(name)
            continue
        top, flagged, info = parallel_rows(w)
        worst = max(worst, top)
        layers[name] = {"max_cos": top, "rows": int(flagged.sum()), **info}
        if flagged.any():
            some = "at least " if info["capped"] else ""
            reasons.append(f"parallel rows: layer '{name}' ({rows} x {cols}) has {some}{int(flagged.sum())} row(s) that are near "
                           f"multiples of another row (|cos| up to {top:.6f} >= {PARALLEL_COS:g}): one measurement direction "
                           f"repeated, as a trap's or an imprint's bins are")
        elif info["capped"]:  # fail closed: rows just under the threshold could fill the screen ahead of a trap's
            reasons.append(f"parallel rows: layer '{name}' ({rows} x {cols}) has more than {MAX_CANDIDATES} pairs of rows "
                           f"near-parallel in the screen (|cos| >= {PARALLEL_COS - SCREEN_MARGIN:g} projected; benign hidden "
                           f"layers <= 0.475): past what is compared exactly, not judged whole, refused")
    found: dict[str, Any] = {"max_cos": worst, "layers": layers}
    if not_examined:
        found["not_examined"] = {k: f"more than {PARALLEL_MAX_ROWS} rows" for k in not_examined}
    return reasons, found


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


def _runnable(received, reference, state, architecture_ok: bool) -> tuple[nn.Module | None, str | None]:
    """The module to run the batch on, or (None, a reason when the received state does not load)."""
    if isinstance(received, nn.Module):
        return received, None
    if not isinstance(reference, nn.Module):
        raise ConfigError("batch: needs a model to run: pass received as an nn.Module, or reference as the client's nn.Module")
    if not architecture_ok:
        return None, None
    if _has_meta(reference):
        raise ConfigError("reference: its tensors are on the meta device (no values): the batch needs a materialised "
                          "module to load the received state into")
    try:
        module = copy.deepcopy(reference)
    except Exception as err:  # noqa: BLE001 - a module holding a lock, a file, a generator...: one line, naming it
        raise ConfigError(f"reference: cannot be copied to load the received state into ({type(err).__name__}: "
                          f"{_first_line(err)}); pass received as the client's nn.Module with the state loaded") from None
    try:
        module.load_state_dict(state)
    except (RuntimeError, TypeError, ValueError) as err:
        return None, f"unusable: the received state does not load into the reference module ({_first_line(err)})"
    return module, None


def _valid_batch(batch) -> tuple[Tensor, Tensor]:
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2 and all(isinstance(t, Tensor) for t in batch)):
        raise ConfigError("batch: expected (x, y), two tensors: the client's first batch and its class labels")
    x, y = batch
    if x.dim() == 0 or y.dim() != 1 or y.dtype not in _INTEGER_DTYPES[1:] or y.shape[0] != x.shape[0]:
        raise ConfigError(f"batch: y must hold one integer class label per sample (x has shape {list(x.shape)}, "
                          f"y has shape {list(y.shape)} and dtype {y.dtype})")
    if x.shape[0] == 0:
        raise ConfigError("batch: x holds no samples (shape [0, ...]); pass the client's first non-empty batch")
    if x.is_meta or y.is_meta:
        raise ConfigError("batch: x and y must hold values (not on the meta device)")
    return x, y


def _float(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.detach().cpu() if t.is_floating_point() else t.detach().cpu().double()


def _outputs(out) -> list[Tensor]:
    """The floating-point tensors in a module's output (a tensor, or a tuple / list / dict of them)."""
    if isinstance(out, Tensor):
        return [out] if out.is_floating_point() or out.is_complex() else []
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _outputs(o)]
    if isinstance(out, Mapping):
        return [t for o in out.values() for t in _outputs(o)]
    return []


class _training_forward:
    """The module as the client trains it, for one forward pass of the checks: BatchNorm normalises with the
    batch's own statistics (train mode), as in the client's training step, without touching its running
    buffers (``track_running_stats`` off for the pass); every other module is in eval mode (dropout off: the
    checks are deterministic). In eval mode a server could set running statistics that make the batch look
    benign (every sample normalised into one state) while the batch statistics the client trains with
    separate its samples."""

    def __init__(self, module: nn.Module):
        self.module = module

    def __enter__(self) -> nn.Module:
        self.was = {m: m.training for m in self.module.modules()}
        self.bns = {m: m.track_running_stats for m in self.module.modules()
                    if isinstance(m, nn.modules.batchnorm._BatchNorm)}
        self.module.eval()
        for m in self.bns:
            m.train()
            m.track_running_stats = False
        return self.module

    def __exit__(self, *exc) -> None:
        for m, tracked in self.bns.items():
            m.track_running_stats = tracked
        for m, was in self.was.items():
            m.training = was


class _eval_forward(_training_forward):
    """The module in eval mode for one forward pass (where train mode cannot run on the batch)."""

    def __enter__(self) -> nn.Module:
        self.was = {m: m.training for m in self.module.modules()}
        self.bns = {}
        self.module.eval()
        return self.module


#: normalisations whose output is examined for isolation when they read a linear layer's output
_NORMS = (nn.BatchNorm1d, nn.LayerNorm, nn.GroupNorm)


def _record(ran: list, names: Mapping[int, str], m: nn.Module, inp, out) -> None:
    """A forward hook's record of the layers the isolation checks differentiate: every ``nn.Linear`` (name,
    module, output, input), and a normalisation that runs next after a linear layer, as ``'linear ->
    norm'`` (its output; no input: the per-sample norms of the concentration check need the linear
    layer's own). Whatever sits between them (a reshape, a dropout, an activation) is not required to
    pass the linear layer's output tensor through unchanged: a model cannot hide its normalisation's
    output from the check by a view in between."""
    if isinstance(m, nn.Linear) and id(m) in names:
        ran.append((names[id(m)], m, out, inp[0] if inp and isinstance(inp[0], Tensor) else None))
    elif isinstance(m, _NORMS) and id(m) in names and ran and isinstance(ran[-1][1], nn.Linear):
        ran.append((f"{ran[-1][0]} -> {names[id(m)]}", m, out, None))


def _batch_checks(module: nn.Module, batch, examined: str | None = None, baseline: nn.Module | None = None,
                  disaggregation: bool = False, signals_out: dict | None = None) -> tuple[list[str], dict[str, dict[str, Any]]]:
    """The output and gradient checks on the batch. ``examined``: the layer the weight checks took for the
    classifier (the last 2-D weight); when another layer computes the logits, its weights are checked too.
    ``baseline``: the client's architecture (the reference module, or the received one), whose fresh
    initialisation's isolation on the same batch is what the received model's is judged against.
    ``signals_out``: filled with the judged linear layers' ``(delta, input)`` (for ``LeakHistory``)."""
    x, y = _valid_batch(batch)
    linear = [(name, m) for name, m in module.named_modules() if isinstance(m, nn.Linear)]
    if not linear:
        return [], {"batch": {"skipped": "the model has no nn.Linear classification layer"}}
    ran: list[tuple[str, nn.Module, Any, Any]] = []  # linear layers (and their normalisations) as they ran
    bad: list[str] = []  # the first module whose output held NaN / inf
    names = {id(m): name for name, m in module.named_modules()}

    def watch(name):
        def hook(m, inp, out):
            _record(ran, names, m, inp, out)
            if not bad and any(not bool(torch.isfinite(t).all()) for t in _outputs(out)):
                bad.append(name or "the model")
        return hook

    leaves = [(name, m) for name, m in module.named_modules() if not any(True for _ in m.children()) or isinstance(m, nn.Linear)]
    hooks = []
    try:
        for name, m in leaves:  # one at a time: a failure part-way still removes those already registered
            hooks.append(m.register_forward_hook(watch(name)))
        device = next((p.device for p in module.parameters()), torch.device("cpu"))
        # with autograd (the isolation and per-layer concentration checks differentiate the loss with
        # respect to the layers' outputs; parameters' .grad is never touched)
        inputs = x.detach().to(device)
        if inputs.is_floating_point():
            inputs.requires_grad_(True)
        mode = "train (BatchNorm on the batch's statistics, as the client trains; dropout off)"
        try:
            with torch.enable_grad(), _training_forward(module):
                out = module(inputs)
        except Exception as train_err:  # noqa: BLE001 - e.g. BatchNorm on one sample: the client cannot train on it
            ran.clear()
            bad.clear()
            with torch.enable_grad(), _eval_forward(module):
                out = module(inputs)
            mode = f"eval: train mode fails on this batch ({_first_line(train_err)}), so the client cannot train on it either"
    except Exception as err:  # noqa: BLE001 - the client's model on the client's batch: a bad batch argument
        raise ConfigError(f"batch: the model cannot run on x of shape {list(x.shape)} ({x.dtype}): {_first_line(err)}") from None
    finally:
        for h in hooks:
            h.remove()
    if not bad and any(not bool(torch.isfinite(t).all()) for t in _outputs(out)):
        bad.append("the model")
    if bad:
        return ([f"non-finite: the forward pass on the batch gives NaN or infinite activations (first in '{bad[0]}'): "
                 f"the model cannot be trained on"], {"batch": {"non_finite_in": bad[0]}})
    n = x.shape[0]
    if not ran:
        return ([f"batch: none of the model's {len(linear)} nn.Linear layer(s) ran on the batch "
                 f"({_some(name for name, _ in linear)}): the layers the weight checks examined do not compute its output"],
                {"batch": {"skipped": "no nn.Linear layer ran"}})
    heads = [(name, m, o) for name, m, o, _ in ran
             if isinstance(m, nn.Linear) and isinstance(o, Tensor) and o.dim() == 2 and o.shape[0] == n]
    if not heads:
        return [], {"batch": {"skipped": f"no nn.Linear layer gave one row of logits per sample (shape [{n}, classes])"}}
    name, head, raw_logits = heads[-1]
    info: dict[str, Any] = {"classifier": name, "mode": mode}
    not_run = [k for k, m in linear if all(m is not r for _, r, _, _ in ran)]
    if not_run:
        info["not_run"] = not_run
    reasons = []
    if name != examined:
        head_reasons, info["class_fishing"] = _class_fishing(name, *(_float(t) for t in (head.weight, head.bias)))
        reasons += head_reasons
    logits = raw_logits.detach().double().cpu()
    classes = logits.shape[1]
    y = y.long().cpu()
    if int(y.min()) < 0 or int(y.max()) >= classes:
        raise ConfigError(f"batch: label {int(y.max()) if int(y.max()) >= classes else int(y.min())} is out of range for "
                          f"{classes} classes (the classification layer '{name}' has {classes} outputs)")
    probs = torch.softmax(logits, dim=1)
    onehot = torch.nn.functional.one_hot(y, classes).double()

    mean, cls, unanimous = output_collapse(probs, y)
    checks = {"batch": info,
              "output_collapse": {"class": cls, "mean_probability": mean, "unanimous": unanimous,
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
    base, source = (_baseline_isolation(baseline, module, x, y, train=mode.startswith("train")) if baseline is not None
                    else (None, None))
    layer_reasons, checks["isolation"], per_layer, reading_hidden, signals = _layer_gradients(ran, raw_logits, y, labels, base,
                                                                                              inputs)
    if signals_out is not None:
        signals_out.update(signals)
    if source:
        checks["isolation"]["baseline_model"] = source
    reasons += layer_reasons
    column_reasons, checks["shared_columns"] = inspect_columns.check(reading_hidden)
    reasons += column_reasons
    checks["gradient_concentration"]["layers"] = per_layer
    if disaggregation:
        dsnr_reasons, checks["disaggregation"] = _disaggregation(module, x, y)
        reasons += dsnr_reasons
    return reasons, checks


def check_leak_limit(value: Any, field: str, unit: str) -> None:
    """A leak limit must be None or an integer >= 0: else one line naming ``field`` (the caller's name for
    it) and the range. The one check, for ``inspect_model`` and every integration."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ConfigError(f"{field}: expected None or an integer >= 0 ({unit}; got {value!r})")


def leak_limit_check(isolation: Mapping[str, Any] | None, n: int, limit: int) -> tuple[list[str], dict[str, Any]]:
    """``inspect_model(leak_limit=)``: the samples of the batch (``n``) a server reads from the update's
    linear layers, by the isolation check's count (``isolation["samples_read"]``: the union over every
    layer it judges), against ``limit``. Fails closed: a layer too large to examine, or an isolation check
    that could not be made, refuses the model (the limit cannot be vouched for). Not counted: the
    classification layer (a class with one sample is read there from any confident model: its
    penultimate features, not its input) and convolutions (never examined for isolation: their weight
    gradient sums over positions, and what an optimisation attack reads from them is the red team's to
    measure). Reads are counted as the isolation check counts them: a sample within a relative error of
    ``ISOLATION_READ_ERROR`` (exact, by the red team's measure); partial reads (a few samples mixed, SSIM
    0.4-0.9) are not counted, and the certificate measures those. Behind a normalisation of a linear
    layer's output the count (taken at the normalisation's output) is no bound: a server undoes it with
    terms estimated on its own data (``trap_weights``; measured 2026-11-28 on 64 LFW faces: the boosted
    median trap reads 2 faces exactly through BatchNorm where the count is 1, and 4-11 past SSIM 0.4
    where it is 0 or 1; the whole-layer trap 10 exactly through GroupNorm where it is 7; through
    LayerNorm no read passed the count in 8 runs, refused on the same grounds), so such a model is
    refused under a limit, the honest one included."""
    check: dict[str, Any] = {"limit": limit, "batch": n,
                             "scope": "nn.Linear layers but the classification layer (convolutions not examined); one update: "
                                      "no bound on what a server reads by querying one batch repeatedly"}
    if not isolation or "skipped" in isolation or "samples_read" not in isolation:
        why = (isolation or {}).get("skipped", "the isolation check did not run on the batch")
        check["skipped"] = why
        return [f"leak limit: what a server reads of the batch could not be counted ({why}): not vouched for, refused"], check
    read = list(isolation["samples_read"])
    check.update(read=len(read), samples=read)
    reasons = []
    if len(read) > limit:
        layers = {name: layer["isolated"] for name, layer in isolation.get("layers", {}).items()
                  if layer.get("judged", True) and layer["isolated"]}
        where = _some(f"'{name}' {count}" for name, count in sorted(layers.items(), key=lambda kv: -kv[1]))
        reasons.append(f"leak limit: a server reads {len(read)} of the batch's {n} samples from this model's update "
                       f"(by layer: {where}), more than leak_limit = {limit} (if this is the honest model: centred inputs, a larger "
                       f"batch or a defense on the update lower it)")
    for item in isolation.get("not_examined", []):
        reasons.append(f"leak limit: layer {item} is past what the isolation check examines: the limit is not vouched for, refused")
    for name, layer in isolation.get("layers", {}).items():
        if layer.get("normalised_by"):
            reasons.append(f"leak limit: '{name}' normalises a linear layer's output ({layer['normalised_by']}), behind which "
                           f"the count is no bound (trap_weights reads faces exactly through BatchNorm and GroupNorm "
                           f"where it counts fewer): the limit is not vouched for, refused")
    return reasons, check


def _leak_history(history: LeakHistory, batch, signals, check: dict[str, Any], limit: int) -> list[str]:
    """``inspect_model(leak_limit=, history=)``: the limit on this update's reads, its differences' with every
    remembered update of the same batch and what those gave away, together (``check`` updated in place:
    ``history``, ``read_with_history``, ``all_samples``)."""
    x, y = _valid_batch(batch)
    now = set(check.get("samples", []))
    earlier, info = history.reads(x, y, signals)
    total = now | earlier
    check.update(history=info, read_with_history=len(total), all_samples=sorted(total),
                 scope="nn.Linear layers but the classification layer (convolutions not examined): this update, its difference "
                       "with every update this client sent on the same batch, where two of those views meet in one sample "
                       "(layers whose input is the batch every round; a line two views share, cut by a third, too), and what "
                       "those gave away; not views of rank above half the batch, reads by image priors, nor batches that "
                       "change between rounds")
    reasons = []
    if info.get("full"):
        reasons.append(f"leak limit: this batch was answered {info['rounds']} times, all its history remembers (max_rounds = "
                       f"{history.max_rounds}; inspect_leak_history={{'max_rounds': n}} in the integrations, or "
                       f"LeakHistory(max_rounds=n), for more): what differences with more rounds read is not vouched for, refused")
    if info.get("views_full"):
        reasons.append(f"leak limit: the views of this batch's {info['rounds']} rounds fill what the history keeps "
                       f"(guardfl.inspect_meets.MEET_MAX_FLOATS), or one holds non-finite coefficients: where they meet is not "
                       f"vouched for, refused")
    if info.get("dropped"):
        reasons.append(f"leak limit: this batch was answered before, but its rounds were dropped from the history (more "
                       f"than max_batches = {history.max_batches} batches since): what differences with them read is not "
                       f"vouched for, refused")
    if len(total) > limit >= len(now):  # else the one-update reason says it already
        reasons.append(f"leak limit: a server reads {len(total)} of the batch's {len(x)} samples with this update and the "
                       f"{info['rounds']} this client sent before on the same batch ({info['read_by_differences']} by "
                       f"differencing this update with one of them, {info['read_by_meets']} where two views of them meet, "
                       f"{info['read_before']} given away before), more than "
                       f"leak_limit = {limit}")
    return reasons


def _disaggregation(module: nn.Module, x: Tensor, y: Tensor) -> tuple[list[str], dict[str, Any]]:
    """SEER's D-SNR check (see ``DSNR_THRESHOLD``) on the batch, in train mode."""
    try:
        norms, skipped = per_sample_weight_norms(module, x, y)
    except Exception as err:  # noqa: BLE001 - train mode can fail where eval mode ran (batch norm on 1 sample)
        return [], {"skipped": f"the model cannot run in train mode on the batch ({_first_line(err)})"}
    if not norms:
        return [], {"skipped": "no nn.Linear or nn.Conv2d weight received a gradient in train mode"}
    bad = [k for k, v in norms.items() if not bool(torch.isfinite(v).all())]
    if bad:
        return ([f"non-finite: the train-mode per-sample gradients of {_some(bad)} hold NaN or infinite values: "
                 f"the model cannot be trained on"], {"non_finite_in": bad})
    per_layer = {k: disaggregation_snr(v) for k, v in norms.items()}
    layer = max(per_layer, key=lambda k: per_layer[k][0])
    value, sample = per_layer[layer]
    judged = x.shape[0] >= DSNR_MIN_BATCH
    info: dict[str, Any] = {"max": value, "layer": layer, "sample": sample, "judged": judged, "mode": "train",
                            "layers": {k: v for k, (v, _) in per_layer.items()}}
    if skipped:
        info["not_examined"] = skipped
    if judged and value > DSNR_THRESHOLD:
        return ([f"disaggregation: sample {sample} of {x.shape[0]} carries {value:.3g} times the gradient of all the others "
                 f"together in '{layer}' (D-SNR > {DSNR_THRESHOLD:g}, Garov et al. 2024; model in train mode): the update "
                 f"would be that one sample's"], info)
    return [], info


def _isolation_reason(name: str, isolated: int, n: int, baseline: int | None, groups: bool = False) -> str | None:
    """The isolation reason for one layer, or None: ``isolated`` at or above ``isolation_limit(n,
    baseline)``, ``baseline`` the count of the client's architecture at a fresh initialisation on the same
    batch (None: no baseline could be made, not judged). ``groups``: the count with combinations of two
    groups of rows (``guardfl.inspect_groups``), else by one or two rows alone."""
    how = ("one row, the difference of two rows or a combination of two groups of rows of one support each, after "
           "peeling" if groups else "one row, or the difference of two rows after peeling")
    if " -> " in name:
        what = (f"layer '{name}' singles out {isolated} of {n} samples in the gradient at the normalisation's output "
                f"({how.replace('row', 'unit')}, holds the sample alone: the server reads those samples' inputs to the "
                f"linear layer up to terms shared by the batch)")
    else:
        what = (f"layer '{name}' singles out {isolated} of {n} samples in its weight gradient ({how}, holds the sample "
                f"alone: the server reads those samples' inputs to the layer)")
    if baseline is None:
        return None
    limit = isolation_limit(n, baseline)
    if isolated < limit:
        return None
    if limit == isolation_threshold(n):
        return (f"isolation: {what}, where the client's architecture at a fresh initialisation singles out {baseline} "
                f"(flagged at >= {ISOLATION_MIN_SAMPLES} and >= {ISOLATION_SHARE:.0%} of the batch)")
    return (f"isolation: {what}, {isolated - baseline} more than the client's architecture at a fresh initialisation "
            f"({baseline}: its own leak on these inputs); flagged at >= {limit:.1f} (the threshold plus "
            f"{ISOLATION_SPREAD:g} standard deviations of chance)")


def _has_meta(module: nn.Module) -> bool:
    """Whether any tensor of ``module``'s state is on the meta device (no values to run on)."""
    return any(t.is_meta for t in module.state_dict().values() if isinstance(t, Tensor))


def _fresh_init(reference: nn.Module) -> nn.Module | None:
    """A copy of the client's architecture with every module that has ``reset_parameters`` re-initialised
    from ``ISOLATION_INIT_SEED`` (the global RNG untouched): the isolation check's baseline, which no
    server's weights shape. None when it cannot be made (meta tensors, a module that cannot be copied or
    reset)."""
    if _has_meta(reference):
        return None
    try:
        fresh = copy.deepcopy(reference)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(ISOLATION_INIT_SEED)
            for m in fresh.modules():
                reset = _reset_of(m)
                if reset is not None:
                    reset()
    except Exception:  # noqa: BLE001 - an architecture that cannot be re-initialised: no baseline
        return None
    return fresh


def _reset_of(module: nn.Module):
    """The method that re-initialises ``module``'s own parameters: ``reset_parameters``, or for torch.nn's
    own modules that have only the private one (``nn.MultiheadAttention``, ``nn.Transformer``)
    ``_reset_parameters``; None for a module that has neither."""
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        return reset
    private = getattr(module, "_reset_parameters", None)
    return private if callable(private) and type(module).__module__.startswith("torch.nn") else None


def kept_at_fresh_init(module: nn.Module) -> list[str]:
    """The parameters of ``module`` that the isolation check's fresh initialisation (``_fresh_init``) keeps
    as they are: those of modules with no reset method (a custom module's own ``nn.Parameter``, torchvision
    ViT's class token and positional embedding). Their values come from the model the baseline is made
    of: the reference when the client gives one, else the received model, the server's."""
    kept = []
    for prefix, m in module.named_modules():
        if _reset_of(m) is None:
            kept += [f"{prefix}.{n}" if prefix else n for n, _ in m.named_parameters(recurse=False)]
    return kept


def _baseline_isolation(reference: nn.Module, received: nn.Module, x: Tensor, y: Tensor,
                        train: bool = True) -> tuple[dict[str, dict[str, int]] | None, str | None]:
    """Samples isolated per ``nn.Linear`` layer, on the same batch, by the client's architecture at a fresh
    initialisation (``_fresh_init``), and which model that was. Where no fresh copy can be made, the
    reference module's own weights when it is the client's and not the received module (fail closed: the
    counts are still judged, against a baseline a server may have shaped, and ``checks`` says so); else
    (None, None): the counts are then not judged."""
    baseline, source = _fresh_init(reference), f"a fresh initialisation (seed {ISOLATION_INIT_SEED})"
    kept = [] if baseline is None else kept_at_fresh_init(reference)
    if kept:
        owner = "the reference, the client's" if reference is not received else "the received model, the server's"
        shown = ", ".join(kept[:5]) + (f" and {len(kept) - 5} more" if len(kept) > 5 else "")
        source += (f", except {len(kept)} parameter(s) no reset method covers, kept as they are in {owner}: {shown} "
                   "(a server that sets them shapes the baseline too)")
    if baseline is None and reference is not received:
        baseline, source = reference, "the reference's own weights: its architecture could not be re-initialised"
    counts = None if baseline is None else _isolation_counts(baseline, x, y, train)
    return counts, (source if counts is not None else None)


def _isolation_counts(baseline: nn.Module, x: Tensor, y: Tensor, train: bool) -> dict[str, dict[str, int]] | None:
    """Samples isolated per ``nn.Linear`` layer by ``baseline`` on the batch, in all (``isolated``) and by one
    or two rows alone (``by_pairs``); None when it cannot run."""
    if _has_meta(baseline):
        return None
    names = {id(m): name for name, m in baseline.named_modules()}
    ran: list = []
    hooks = [m.register_forward_hook(lambda m, i, o: _record(ran, names, m, i, o))
             for m in baseline.modules() if isinstance(m, (nn.Linear, *_NORMS))]
    try:
        inputs = x.detach().to(next((p.device for p in baseline.parameters()), torch.device("cpu")))
        if inputs.is_floating_point():
            inputs.requires_grad_(True)
        with torch.enable_grad(), (_training_forward(baseline) if train else _eval_forward(baseline)):
            baseline(inputs)
    except Exception:  # noqa: BLE001 - the baseline model cannot run on the batch: no baseline
        return None
    finally:
        for h in hooks:
            h.remove()
    heads = [o for _, m, o, _ in ran
             if isinstance(m, nn.Linear) and isinstance(o, Tensor) and o.dim() == 2 and o.shape[0] == x.shape[0]]
    if not heads:
        return None
    _, isolation, _, _, _ = _layer_gradients(ran, heads[-1], y, int(y.unique().numel()), None, inputs)
    return {name: {"isolated": layer["isolated"], "by_pairs": layer["by_pairs"]}
            for name, layer in isolation.get("layers", {}).items()}


def _layer_gradients(ran, logits: Tensor, y: Tensor, labels: int, baseline: dict[str, dict[str, int]] | None,
                     inputs: Tensor) -> tuple[list[str], dict[str, Any], dict[str, Any], list[tuple[str, Tensor, Tensor]]]:
    """Isolation and per-layer gradient concentration: the batch's summed cross-entropy differentiated
    with respect to every ``nn.Linear`` layer's output (one row per sample), which gives each sample's
    coefficients ``delta`` in that layer's weight gradient ``sum_n delta_n a_n^T``. ``baseline``: the
    samples the client's architecture at a fresh initialisation isolates per layer (``isolation_limit``);
    None: the counts are reported, not judged. Also ``(name, delta, weight)`` of every linear layer
    that reads hidden units (its input is not the model's ``inputs``), for the shared-columns check."""
    n = logits.shape[0]
    layers = [(name, out, a, m) for name, m, out, a in ran
              if isinstance(out, Tensor) and out.dim() == 2 and out.shape[0] == n and out.requires_grad]
    if not layers or not logits.requires_grad:
        why = "the model's linear layers do not depend on anything differentiable (no float input, no trainable weight)"
        return [], {"skipped": why}, {}, [], {}
    loss = torch.nn.functional.cross_entropy(logits.double(), y.to(logits.device), reduction="sum")
    grads = torch.autograd.grad(loss, [out for _, out, _, _ in layers], allow_unused=True)
    reasons: list[str] = []
    isolation: dict[str, Any] = {"layers": {}, "not_examined": []}
    per_layer: dict[str, Any] = {}
    judged = n >= CONCENTRATION_MIN_BATCH and labels >= 2
    worst, reading_hidden, read = 0, [], set()
    signals: dict[str, tuple[Tensor, Tensor]] = {}  # judged linear layers' (delta, input): ``LeakHistory``'s differences
    linear_inputs = {name: a for name, _, a, m in layers if isinstance(m, nn.Linear)}
    for (name, out, a, m), g in zip(layers, grads):
        delta = torch.zeros_like(out, dtype=torch.float64) if g is None else g.detach().double().cpu()
        if isinstance(m, nn.Linear) and a is not None and not _reads_input(a, inputs):
            reading_hidden.append((name, delta, m.weight))
        if delta.shape[1] > ISOLATION_MAX_UNITS:
            isolation["not_examined"].append(f"{name} ({delta.shape[1]} units > {ISOLATION_MAX_UNITS})")
        else:
            # the read is of the linear layer's input, also behind its normalisation ('linear -> norm')
            found, info = isolated_samples(delta, linear_inputs.get(name.split(" -> ")[0]), peel_rows=not isinstance(m, _NORMS))
            isolation["layers"][name] = {"isolated": len(found), **info}
            if isinstance(m, _NORMS):  # a normalisation's output: no bound for ``leak_limit_check``
                isolation["layers"][name]["normalised_by"] = type(m).__name__
            if out is logits:
                # the classification layer: a confident model's row k holds only the samples of label k
                # (softmax saturates), so a class with one sample is isolated there, trained or not: its
                # penultimate features, iDLG's known leak, not an edit. Reported, not judged
                isolation["layers"][name]["judged"] = False
                continue
            worst = max(worst, len(found))
            read.update(found)
            if isinstance(m, nn.Linear) and a is not None and a.dim() == 2 and a.shape[0] == n:
                signals[name] = (delta, a.detach().double().cpu())
            base = None if baseline is None else baseline.get(name, {"isolated": 0, "by_pairs": 0})
            reason = (_isolation_reason(name, info["by_pairs"], n, None if base is None else base["by_pairs"])
                      or _isolation_reason(name, len(found), n, None if base is None else base["isolated"], groups=True))
            if reason:
                reasons.append(reason)
            elif info.get("groups_capped"):  # fail closed: a server could hide a trap behind decoy groups
                reasons.append(f"isolation: layer '{name}' has more than {GROUP_MAX_PAIRS} nested pairs of groups of rows "
                               f"with one support each on this batch, past what is examined: not judged whole, refused")
        if a is None or a.dim() != 2 or a.shape[0] != n:
            continue
        norms = delta.norm(dim=1) * a.detach().double().cpu().norm(dim=1)  # |delta_n a_n^T| = |delta_n| |a_n|
        share, i, class_share, c = concentration(norms, y.cpu(), int(y.max()) + 1)
        per_layer[name] = {"sample_share": share, "class_share": class_share}
        if judged and share > CONCENTRATION_SHARE:
            reasons.append(f"gradient concentration: sample {i} of {n} carries {share:.1%} of layer '{name}''s weight "
                           f"gradient (> {CONCENTRATION_SHARE:.0%}): that layer's update would be that one sample's")
        elif judged and class_share > CONCENTRATION_SHARE:
            reasons.append(f"gradient concentration: the {int((y == c).sum())} sample(s) of label {c} carry {class_share:.1%} "
                           f"of layer '{name}''s weight gradient (> {CONCENTRATION_SHARE:.0%}) of a batch of {n} with "
                           f"{labels} labels")
    isolation["max_isolated"] = worst
    isolation["samples_read"] = sorted(read)  # by any judged layer: what ``leak_limit`` limits
    if baseline is None:
        isolation["rule"] = "not judged: the client's architecture could not be re-initialised or run on the batch"
    else:
        isolation["rule"] = (f"flagged at >= max({ISOLATION_MIN_SAMPLES}, {ISOLATION_SHARE:.0%} of the batch) where the client's "
                             f"architecture at a fresh initialisation (baseline) isolates fewer; otherwise at the baseline "
                             f"plus that plus {ISOLATION_SPREAD:g} binomial standard deviations; judged twice: the samples "
                             f"read by one or two rows ('by_pairs', against the baseline's), and those read with "
                             f"combinations of two groups of rows too ('isolated')")
        isolation["baseline"] = {name: counts["isolated"] for name, counts in baseline.items()}
        isolation["baseline_by_pairs"] = {name: counts["by_pairs"] for name, counts in baseline.items()}
    if not isolation["not_examined"]:
        del isolation["not_examined"]
    return reasons, isolation, per_layer, reading_hidden, signals


def _reads_input(a: Tensor, inputs: Tensor) -> bool:
    """Whether a linear layer's input ``a`` is the model's input (flattened or not): its columns are then
    pixels or features of the data, not units of the model."""
    return a.shape[0] == inputs.shape[0] and a.numel() == inputs.numel() and bool(torch.equal(
        a.detach().reshape(a.shape[0], -1).to(inputs.device, inputs.dtype), inputs.detach().reshape(inputs.shape[0], -1)))


__all__ = [
    "BIAS_GAP_LOGITS",
    "CHUNK_ELEMENTS",
    "COLLAPSE_PROBABILITY",
    "CONCENTRATION_LABEL_FRACTION",
    "CONCENTRATION_MIN_BATCH",
    "CONCENTRATION_SHARE",
    "DSNR_MIN_BATCH",
    "DSNR_THRESHOLD",
    "DUPLICATE_ROW_SHARE",
    "EXACT_SVD_COST",
    "IMPRINT_MIN_ROWS",
    "ISOLATION_INIT_SEED",
    "ISOLATION_MAX_UNITS",
    "ISOLATION_MIN_SAMPLES",
    "ISOLATION_PEEL",
    "ISOLATION_READ_ERROR",
    "ISOLATION_SHARE",
    "ISOLATION_SPREAD",
    "ISOLATION_TOLERANCE",
    "Inspection",
    "MAX_TENSOR_ELEMENTS",
    "MONOTONE_SHARE",
    "RANK_ONE_RATIO",
    "ZERO_ROW_RELATIVE",
    "ZERO_ROW_SHARE",
    "architecture_mismatch",
    "bias_gap",
    "check_leak_limit",
    "disaggregation_snr",
    "duplicate_row_share",
    "leak_limit_check",
    "concentration",
    "gradient_shares",
    "inspect_model",
    "isolated_samples",
    "kept_at_fresh_init",
    "isolation_limit",
    "isolation_threshold",
    "output_collapse",
    "per_sample_weight_norms",
    "rank_ratio",
    "threshold_monotone_share",
    "zero_row_share",
]
