"""A benign model zoo: honestly trained models that ``guardfl.inspect_model`` must accept (issue 66).

Generated, never checked in: ``recipes()`` lists the models, ``build(recipe)`` trains one and returns the
model a server would send, the client's own model of that architecture (the ``reference``) and the
client's first batch. Shared by ``bench/bench_inspect_zoo.py`` (the false-positive table) and the tests.

What varies (every recipe names its values, so a finding is reproducible from its name):

- **architectures**: the red team's own (``fc2``, ``fc2bn``, ``fc2ln``, ``fc2gn``, ``lenet``, ``convnet``,
  ``resnet20`` and ``resnet18`` with BatchNorm, ``text-classifier``, ``transformer3`` and its tied form);
- **data**: CIFAR-10 normalised (``cifar``) and in [0, 1] (``cifar01``; the shared 5k sample, benches only),
  LFW faces in [0, 1] (``lfw``, scikit-image's subset: always there), the built-in English text (GPT-2 BPE);
- **optimizers**: SGD, SGD with momentum 0.9, Adam, AdamW, each at three learning rates two orders of
  magnitude apart; weight decay on and off; lengths from initialisation to (small-data) convergence;
- **FedAvg** rounds over 4 non-IID clients (each of 3 classes), the client's batch from its own shard;
- **degenerate but honest**: fresh initialisations, dead ReLUs (a quarter of the units pruned, or never
  firing after a step too large), rows converged together (a large step on inputs in [0, 1]: every row
  moves along the mean input), a model right after a learning-rate spike, a diverged-and-recovered run;
- **batches**: the client's first batch, of 8, 16, 32 or 64 samples, IID or from a non-IID shard.

torchvision's pretrained weights do not load here (no network, no cached checkpoint): ``pretrained()``
says so, and the zoo has none unless they are in ``$TORCH_HOME``.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from torch import nn

from tests import malicious as M

#: optimizers and their three learning rates (two orders of magnitude apart)
OPTIMIZERS = {"sgd": (0.005, 0.05, 0.5), "sgdm": (0.001, 0.01, 0.1), "adam": (1e-4, 1e-3, 1e-2),
              "adamw": (1e-4, 1e-3, 1e-2)}
#: training lengths (steps of batch 32) by architecture cost
LENGTHS = {"cheap": (10, 60, 300), "resnet20": (5, 25, 100), "resnet18": (3, 8, 20), "text": (10, 60, 200)}
BATCHES = (8, 16, 32, 64)
IMAGE_ARCHS = {"fc2": ("cifar", "cifar01", "lfw"), "fc2bn": ("cifar", "lfw"), "fc2ln": ("cifar", "lfw"),
               "fc2gn": ("cifar", "lfw"), "lenet": ("cifar", "cifar01"), "convnet": ("cifar", "cifar01"),
               "resnet20": ("cifar",), "resnet18": ("cifar",)}
TEXT_ARCHS = ("text-classifier", "transformer3", "transformer3-tied")
#: the text models' context (positions) and sequence length
TEXT_CONTEXT, TEXT_LENGTH = 32, 16


@dataclass
class Benign:
    """One zoo model: what the server sends, what the client has, and the client's first batch."""

    name: str
    recipe: dict[str, Any]
    model: nn.Module
    reference: nn.Module
    batch: tuple[torch.Tensor, torch.Tensor] | None
    notes: dict[str, Any] = field(default_factory=dict)


# -- data ----------------------------------------------------------------------------------------------
def have_cifar() -> bool:
    return M.CIFAR.exists()


@lru_cache(maxsize=None)
def images(kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(train x, train y, held-out x, held-out y) for ``cifar`` (normalised), ``cifar01`` (in [0, 1]) or
    ``lfw`` (faces in [0, 1], synthetic labels ``i % 10`` as the red team gives them)."""
    if kind == "lfw":
        import skimage

        faces = torch.from_numpy(np.load(Path(skimage.__file__).parent / "data" / "lfw_subset.npy")).float()[:, None]
        labels = torch.arange(len(faces)) % 10
        return faces[64:], labels[64:], faces[:64], labels[:64]
    x, y = M.cifar(1024)
    hx, hy = M.cifar(256, offset=4000)
    if kind == "cifar01":
        un = lambda t: (t * M.CIFAR_STD + M.CIFAR_MEAN).clamp(0, 1)  # noqa: E731
        x, hx = un(x), un(hx)
    return x, y, hx, hy


@lru_cache(maxsize=None)
def text(task: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Token sequences of the built-in English text (GPT-2 BPE): (train tokens, train labels or next tokens,
    held-out tokens, held-out labels, vocabulary size); labels ``i % 3`` for the classifier."""
    from guardfl.redteam.modality.text.data import builtin_labelled, builtin_text, classification_sequences, sequences
    from guardfl.redteam.modality.text.tokenizer import load_tokenizer

    tok = load_tokenizer("gpt2")
    if task == "classification":
        texts, labels = builtin_labelled(3)
        x, y = classification_sequences(texts[:1400], labels[:1400], tok, TEXT_LENGTH)
        return x[:1024], y[:1024], x[1024:1280], y[1024:1280], tok.vocab_size
    seqs = sequences(builtin_text()[:400_000], tok, TEXT_LENGTH + 1, limit=1400)
    return seqs[:1024, :-1], seqs[:1024, 1:], seqs[1024:1280, :-1], seqs[1024:1280, 1:], tok.vocab_size


def non_iid_shards(y: torch.Tensor, clients: int = 4, classes_per_client: int = 3) -> list[torch.Tensor]:
    """Indices of ``clients`` non-IID shards: client c holds classes (2c .. 2c + 2) mod the class count."""
    k = int(y.max()) + 1
    return [torch.isin(y, torch.tensor([(c * 2 + j) % k for j in range(classes_per_client)])).nonzero().flatten()
            for c in range(clients)]


# -- models --------------------------------------------------------------------------------------------
def make(arch: str, data: str, seed: int) -> nn.Module:
    """The architecture, PyTorch's default initialisation from ``seed``."""
    from guardfl.redteam.modality.image.models import FC2, FC2BN, FC2GN, FC2LN, ConvNetSmall, LeNetZhu, ResNet20, resnet18_cifar
    from guardfl.redteam.modality.text.models import TextClassifier, Transformer3

    torch.manual_seed(seed)
    if arch in TEXT_ARCHS:
        vocab = text("classification" if arch == "text-classifier" else "lm")[4]
        if arch == "text-classifier":
            return TextClassifier(vocab_size=vocab, num_classes=3, context=TEXT_CONTEXT)
        return Transformer3(vocab_size=vocab, context=TEXT_CONTEXT, tied=arch.endswith("tied"))
    shape = (1, 25, 25) if data == "lfw" else (3, 32, 32)
    build = {"fc2": FC2, "fc2bn": FC2BN, "fc2ln": FC2LN, "fc2gn": FC2GN, "lenet": LeNetZhu, "convnet": ConvNetSmall,
             "resnet20": ResNet20, "resnet18": resnet18_cifar}[arch]
    return build(in_shape=shape, num_classes=10)


def optimizer(name: str, params, lr: float, wd: float) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, weight_decay=wd)
    if name == "sgdm":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=wd)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=wd)
    return torch.optim.AdamW(params, lr=lr, weight_decay=wd if wd else 0.01)


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = model(x)
    if out.dim() == 3:  # a causal LM: next-token loss over positions
        return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    return nn.functional.cross_entropy(out, y)


def train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, opt: str, lr: float, steps: int, wd: float = 0.0,
          seed: int = 0, batch: int = 32, spike: tuple[int, float] | None = None, clip: float | None = None) -> dict:
    """``steps`` honest steps of ``opt`` on (x, y), in place; ``spike``: (step, factor) multiplies the learning
    rate at that one step (a schedule's warm restart, a mis-set lr); ``clip``: gradient-norm clipping.
    Returns the training record (losses, finite)."""
    o = optimizer(opt, model.parameters(), lr, wd)
    g = torch.Generator().manual_seed(seed)
    model.train()
    losses, order, pos = [], torch.randperm(len(x), generator=g), 0
    for step in range(steps):
        if pos + batch > len(x):
            order, pos = torch.randperm(len(x), generator=g), 0
        idx = order[pos:pos + batch]
        pos += batch
        for group in o.param_groups:
            group["lr"] = lr * (spike[1] if spike is not None and step == spike[0] else 1.0)
        o.zero_grad()
        loss = loss_of(model, x[idx], y[idx])
        loss.backward()
        if clip is not None:
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        o.step()
        losses.append(float(loss))
    return {"first_loss": losses[0] if losses else None, "last_loss": losses[-1] if losses else None}


def fedavg(model: nn.Module, x: torch.Tensor, y: torch.Tensor, rounds: int, opt: str, lr: float, steps: int,
           seed: int) -> nn.Module:
    """``rounds`` FedAvg rounds over 4 non-IID clients (``non_iid_shards``), ``steps`` local steps each;
    floating-point state averaged, integer buffers (BatchNorm's count) from the first client."""
    shards = non_iid_shards(y)
    current = copy.deepcopy(model)
    for rnd in range(rounds):
        states = []
        for c, idx in enumerate(shards):
            local = copy.deepcopy(current)
            train(local, x[idx], y[idx], opt, lr, steps, seed=seed * 100 + rnd * 10 + c)
            states.append(local.state_dict())
        current.load_state_dict({k: torch.stack([s[k].double() for s in states]).mean(0).to(v.dtype)
                                 if v.is_floating_point() else states[0][k] for k, v in current.state_dict().items()})
    return current


def pretrained() -> tuple[nn.Module | None, str]:
    """torchvision's ImageNet ResNet-18 when its weights load offline (a cached checkpoint), else None and why."""
    import torchvision

    try:
        return torchvision.models.resnet18(weights="DEFAULT"), "loaded"
    except Exception as err:  # noqa: BLE001 - no network: the download fails
        return None, f"torchvision pretrained weights do not load offline here ({type(err).__name__})"


# -- the recipes ---------------------------------------------------------------------------------------
def _length_kind(arch: str) -> str:
    return arch if arch in ("resnet20", "resnet18") else "text" if arch in TEXT_ARCHS else "cheap"


def recipes(cifar: bool | None = None, text_models: bool = True, heavy: bool = True) -> list[dict[str, Any]]:
    """Every zoo recipe (``build`` makes each): per architecture and data, the four optimizers at their three
    learning rates (lengths and weight decay cycling through the grid), fresh initialisations, FedAvg over
    non-IID clients, and the degenerate cases. ``cifar``: include the CIFAR-10 data (default: when the
    shared sample exists); ``heavy``: include ResNet-18."""
    cifar = have_cifar() if cifar is None else cifar
    out: list[dict[str, Any]] = []
    batches = itertools.cycle(BATCHES)
    archs = [(a, d) for a, ds in IMAGE_ARCHS.items() for d in ds if (cifar or not d.startswith("cifar"))
             and (heavy or a != "resnet18")]
    if text_models:
        archs += [(a, "text") for a in TEXT_ARCHS]
    for arch, data in archs:
        lengths = LENGTHS[_length_kind(arch)]
        grid = [(o, lr) for o, lrs in OPTIMIZERS.items() for lr in lrs]
        if arch == "resnet18" or arch.startswith("transformer3"):
            grid = grid[1::3]  # one learning rate per optimizer: the costly and the weights-only models
        for i, (opt, lr) in enumerate(grid):
            out.append({"arch": arch, "data": data, "kind": "trained", "opt": opt, "lr": lr,
                        "steps": lengths[i % 3], "wd": (0.0, 5e-4)[(i // 3) % 2], "seed": i, "batch": next(batches)})
        out.append({"arch": arch, "data": data, "kind": "init", "seed": 50, "batch": next(batches)})
        if arch not in ("resnet18", "transformer3", "transformer3-tied"):
            steps = 10 if arch == "resnet20" else 30
            for rounds in (1, 3):
                out.append({"arch": arch, "data": data, "kind": "fedavg", "opt": "sgdm", "lr": 0.01, "steps": steps,
                            "rounds": rounds, "seed": 60 + rounds, "batch": next(batches), "non_iid_batch": True})
    degenerate = [
        # dead ReLUs: a quarter of the hidden units pruned (rows, biases, classifier columns), or never firing
        {"arch": "fc2", "data": "cifar", "kind": "dead", "how": "pruned", "opt": "sgdm", "lr": 0.01, "steps": 60},
        {"arch": "fc2", "data": "lfw", "kind": "dead", "how": "never fire", "opt": "sgdm", "lr": 0.01, "steps": 60},
        # rows converged together: one large step on inputs in [0, 1] moves every row along the mean input
        {"arch": "fc2", "data": "cifar01", "kind": "trained", "opt": "sgd", "lr": 0.5, "steps": 60},
        {"arch": "fc2", "data": "cifar01", "kind": "trained", "opt": "sgdm", "lr": 0.5, "steps": 60},
        {"arch": "fc2", "data": "lfw", "kind": "trained", "opt": "sgdm", "lr": 0.5, "steps": 60},
        {"arch": "fc2", "data": "cifar", "kind": "trained", "opt": "sgd", "lr": 0.5, "steps": 300},
        # right after a learning-rate spike (x50 at the last step), and recovered from one (x50 early)
        {"arch": "fc2", "data": "cifar", "kind": "spike", "opt": "sgdm", "lr": 0.01, "steps": 60, "spike": (59, 50.0)},
        {"arch": "fc2bn", "data": "cifar", "kind": "spike", "opt": "sgdm", "lr": 0.01, "steps": 60, "spike": (59, 50.0)},
        {"arch": "lenet", "data": "cifar", "kind": "spike", "opt": "sgdm", "lr": 0.01, "steps": 60, "spike": (59, 50.0)},
        {"arch": "convnet", "data": "cifar", "kind": "spike", "opt": "adam", "lr": 1e-3, "steps": 60, "spike": (59, 50.0)},
        {"arch": "fc2", "data": "lfw", "kind": "spike", "opt": "adam", "lr": 1e-3, "steps": 60, "spike": (10, 50.0)},
        {"arch": "fc2ln", "data": "cifar", "kind": "spike", "opt": "sgdm", "lr": 0.01, "steps": 60, "spike": (10, 50.0)},
        # the paper-style recipe of the old benign set (tests/malicious.train: SGD lr 0.05 momentum 0.9, 2 epochs)
        *({"arch": a, "data": "cifar", "kind": "old12", "opt": "sgdm", "lr": 0.05, "steps": 64, "seed": s}
          for a in ("fc2", "lenet", "convnet") for s in range(4)),
    ]
    for i, r in enumerate(degenerate):
        r.setdefault("seed", 70 + i)
        r.setdefault("wd", 0.0)
        r.setdefault("batch", 32)
        if cifar or not r["data"].startswith("cifar"):
            out.append(r)
    return out


def name_of(r: dict[str, Any]) -> str:
    parts = [r["arch"], r["data"], r["kind"]]
    if "opt" in r:
        parts.append(f"{r['opt']} lr {r['lr']:g}")
    if r.get("steps") is not None and r["kind"] != "init":
        parts.append(f"{r['steps']} steps")
    if r.get("rounds"):
        parts.append(f"{r['rounds']} rounds non-IID")
    if r.get("wd"):
        parts.append(f"wd {r['wd']:g}")
    if r.get("how"):
        parts.append(r["how"])
    if r.get("spike"):
        parts.append(f"lr x{r['spike'][1]:g} at step {r['spike'][0]}")
    parts.append(f"seed {r['seed']}, batch {r['batch']}{' non-IID' if r.get('non_iid_batch') else ''}")
    return ", ".join(parts)


def _data(r: dict[str, Any]):
    if r["data"] == "text":
        t = text("classification" if r["arch"] == "text-classifier" else "lm")
        return t[:4]
    return images(r["data"])


def client_batch(r: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The client's first batch (held-out samples; from one non-IID shard when the recipe says so); None for
    the causal LMs (no class label per sample: the batch checks do not apply, the weights are checked)."""
    if r["arch"] in ("transformer3", "transformer3-tied"):
        return None
    _, _, hx, hy = _data(r)
    g = torch.Generator().manual_seed(1000 + r["seed"])
    if r.get("non_iid_batch"):
        shard = non_iid_shards(hy)[r["seed"] % 4]
        idx = shard[torch.randperm(len(shard), generator=g)[: r["batch"]]]
    else:
        idx = torch.randperm(len(hx), generator=g)[: r["batch"]]
    return hx[idx], hy[idx]


def build(r: dict[str, Any]) -> Benign:
    """Train the recipe's model (see ``recipes``)."""
    x, y, _, _ = _data(r)
    model = make(r["arch"], r["data"], r["seed"])
    notes: dict[str, Any] = {}
    if r["kind"] in ("trained", "old12", "spike", "dead"):
        notes = train(model, x, y, r["opt"], r["lr"], r["steps"], r.get("wd", 0.0), seed=r["seed"], spike=r.get("spike"))
    elif r["kind"] == "fedavg":
        model = fedavg(model, x, y, r["rounds"], r["opt"], r["lr"], r["steps"], r["seed"])
    if r["kind"] == "dead":
        _kill_units(model, r["how"], r["seed"])
    reference = make(r["arch"], r["data"], 10_000 + r["seed"])  # the client's own model: its own initialisation
    notes["finite"] = all(bool(torch.isfinite(t).all()) for t in model.state_dict().values() if t.is_floating_point())
    return Benign(name_of(r), r, model, reference, client_batch(r), notes)


def _kill_units(model: nn.Module, how: str, seed: int) -> None:
    first, head = model.net[1], model.net[3]
    units = torch.randperm(first.out_features, generator=torch.Generator().manual_seed(seed))[: first.out_features // 4]
    with torch.no_grad():
        if how == "pruned":
            first.weight[units] = 0.0
            first.bias[units] = 0.0
            head.weight[:, units] = 0.0
        else:
            first.bias[units] = -100.0


def zoo(**kwargs: Any) -> Iterator[Benign]:
    """Every recipe built, one at a time (the models are not kept)."""
    for r in recipes(**kwargs):
        yield build(r)
