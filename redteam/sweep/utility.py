"""Utility of a defense: the client's model trained with it through the real client path, tested on
held-out data (the other half of a privacy-utility trade-off).

Training is one ``guardfl.integrations.torch.local_update`` over ``utility.epochs`` epochs (so
``guardfl.protect``: DP-SGD is Opacus with its accounting, input encodings train on encoded batches with
soft labels and are tested on clean inputs, as InstaHide does), SGD with the task's lr and momentum,
from the model's PyTorch initialisation seeded with ``utility.seed`` (or the base config's checkpoint).
Accuracy is measured in eval mode: a classifier's top-1 on held-out samples; a causal language model's
next-token top-1 over every predicted position.

Data: ``lfw-detection`` is built in (LFW's 100 faces, label 1, and its 100 non-face patches, label 0;
25x25 grey, shipped with scikit-image), split at random with ``utility.seed`` into ``train`` and ``test``;
any labelled red-team source works too (CIFAR, MNIST, an npz, an image folder, labelled text, plain
text for a causal LM).
"""

from __future__ import annotations

import math
import time
import warnings
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

from guardfl.errors import ConfigError
from guardfl.redteam import modality


def lfw_detection() -> tuple[Tensor, Tensor]:
    """LFW faces (label 1) and non-face patches (label 0) from ``skimage.data.lfw_subset()``: 200 25x25
    grey images with real labels, the one labelled image task available offline without a download."""
    from guardfl.redteam.modality.image.data import lfw_faces, lfw_nonfaces

    faces, _ = lfw_faces()
    other, _ = lfw_nonfaces()
    x = torch.cat([faces, other])
    y = torch.cat([torch.ones(len(faces), dtype=torch.long), torch.zeros(len(other), dtype=torch.long)])
    return x, y


def _text_task(utility, red: dict[str, Any]) -> str:
    """The task of the base's model, which must be a text model to train on the text source ``utility.source``."""
    from guardfl.redteam.modality.text.models import is_text_model

    model = build(red, (), utility.seed)
    if not is_text_model(model):
        raise ConfigError(f"sweep.utility.source: {utility.source!r} is text but the model {red['model']['name']!r} "
                          "is not a text model (get_input_embeddings and a task)")
    return model.task


def load_task(utility, red: dict[str, Any]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(train inputs, train targets, test inputs, test targets): ``utility``'s data shuffled with its seed
    and split into disjoint ``train`` / ``test`` parts; ``red``: the red-team config (model, tokenizer)."""
    need = utility.train + utility.test
    if utility.source == "lfw-detection":
        x, y = lfw_detection()
    else:  # a text model's task is the model's (built only when the source is text)
        x, y = modality.for_source(utility.source).load(
            utility, num_classes=red["model"]["num_classes"], field="sweep.utility", task=lambda: _text_task(utility, red),
            seq_len=utility.seq_len or red["data"]["seq_len"], tokenizer=red["data"]["tokenizer"])
    if len(x) < need:
        raise ConfigError(f"sweep.utility: {utility.source} has {len(x)} samples; train + test = {need} (lower them)")
    if y.dim() == 1 and (int(y.min()) < 0 or int(y.max()) >= red["model"]["num_classes"]):
        raise ConfigError(f"sweep.utility: labels {int(y.min())}..{int(y.max())} do not fit model.num_classes="
                          f"{red['model']['num_classes']}; allowed: labels in [0, {red['model']['num_classes'] - 1}]")
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(utility.seed))[:need]
    x, y = x[order], y[order]
    return x[: utility.train], y[: utility.train], x[utility.train:], y[utility.train:]


def accuracy(logits: Tensor, targets: Tensor) -> tuple[int, int]:
    """(correct, counted): top-1 over classes; (N, L) targets count every position but -100."""
    pred = logits.argmax(-1)
    keep = targets != -100
    return int((pred[keep] == targets[keep]).sum()), int(keep.sum())


def build(red: dict[str, Any], in_shape: tuple[int, ...], seed: int) -> torch.nn.Module:
    """The base config's model, initialised from ``seed`` (the global RNG is restored afterwards), or
    loaded from its checkpoint when ``model.state`` is a path."""
    from guardfl.redteam.modality.image.models import build_model, set_model_state

    vocab = modality.of(red).vocab_size(red["data"]["tokenizer"])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build_model(red["model"]["name"], in_shape, red["model"]["num_classes"], vocab_size=vocab)
    state = red["model"]["state"]
    if state not in ("default", "wide-init"):  # a checkpoint: the deployment's model
        set_model_state(model, state, seed=seed)
    return model


def evaluate(utility, red: dict[str, Any], defense: dict[str, Any] | None,
             task: tuple[Tensor, Tensor, Tensor, Tensor] | None = None) -> dict[str, Any]:
    """Train the base model with ``defense`` (None: no defense) ``utility.repeats`` times (seeds
    ``utility.seed + r``; a seeded defense's seed shifts with them) and test it: mean accuracy and its
    standard deviation over the repeats, mean training seconds, and epsilon for DP-SGD (the last run's;
    every run spends the same)."""
    task = task if task is not None else load_task(utility, red)
    runs = [train_once(utility, red, _reseeded(defense, r), task, utility.seed + r) for r in range(utility.repeats)]
    accs = [run["accuracy"] for run in runs]
    mean = sum(accs) / len(accs)
    std = (sum((a - mean) ** 2 for a in accs) / (len(accs) - 1)) ** 0.5 if len(accs) > 1 else 0.0
    return {**runs[-1], "accuracy": mean, "accuracy_std": std, "accuracies": accs, "majority": majority(task[3]),
            "train_seconds": sum(run["train_seconds"] for run in runs) / len(runs)}


def majority(targets: Tensor) -> float:
    """The held-out accuracy of always answering the most frequent target (-100 positions ignored): the
    floor a trained model must beat for its accuracy to say anything."""
    kept = targets[targets != -100]
    return float(torch.bincount(kept.flatten()).max()) / max(kept.numel(), 1) if kept.numel() else 0.0


def _reseeded(defense: dict[str, Any] | None, r: int) -> dict[str, Any] | None:
    if defense is None or defense.get("seed") is None or r == 0:
        return defense
    return {**defense, "seed": (defense["seed"] + 7919 * r) % (2**32)}


def train_once(utility, red: dict[str, Any], defense: dict[str, Any] | None,
               task: tuple[Tensor, Tensor, Tensor, Tensor], seed: int) -> dict[str, Any]:
    """One training with ``defense`` from initialisation ``seed``, tested on the held-out part."""
    from guardfl.integrations.torch import ClientState, local_update

    xtr, ytr, xte, yte = task
    model = build(red, tuple(xtr.shape[1:]), seed)
    loader = DataLoader(TensorDataset(xtr, ytr), batch_size=utility.batch_size, shuffle=True,
                        generator=torch.Generator().manual_seed(seed))
    lr, momentum = utility.lr, utility.momentum
    started = time.perf_counter()
    with warnings.catch_warnings():  # Opacus's notes on every DP-SGD training: noise in a sweep's progress
        warnings.filterwarnings("ignore", message="Secure RNG turned off")
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        update = local_update(model, loader, lambda p: torch.optim.SGD(p, lr=lr, momentum=momentum), defense=defense,
                              epochs=utility.epochs, num_classes=red["model"]["num_classes"],
                              state=ClientState())  # one training, round 0 (a seeded defense needs the counter)
    seconds = time.perf_counter() - started
    model.eval()
    correct = counted = 0
    with torch.no_grad():
        for lo in range(0, len(xte), 256):
            c, n = accuracy(model(xte[lo:lo + 256]), yte[lo:lo + 256])
            correct, counted = correct + c, counted + n
    loss_ok = math.isfinite(update.mean_loss)
    return {"accuracy": correct / max(counted, 1), "train_seconds": seconds, "examples": update.num_examples,
            "steps": update.steps, "mean_loss": update.mean_loss if loss_ok else None,
            "epsilon": None if math.isinf(update.epsilon) else update.epsilon, "dp_delta": update.dp_delta}
