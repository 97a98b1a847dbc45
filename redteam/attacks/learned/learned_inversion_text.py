"""Learning To Invert for tokens (Wu et al. 2023, Sec. 4.2): the text maths of ``learned_inversion``.

``LearnedInversion`` (learned_inversion.py) runs one lifecycle for both modalities and calls this module
when the client trains a text model (``Setting.modality == "text"``): token ids ``(B, L)`` in, the
model's next-token (causal LM) or class (classifier) targets as labels.

Preparation: the attacker's auxiliary sequences (``threat.aux.images``: token ids ``(N, L)`` of the
client's length, ``aux.labels`` the client's targets for them) are grouped into random batches of the
client's B and pushed through ``TransmitSimulator`` (the client's loss, protocol and the real guardfl
defense with fresh randomness: the defense is data augmentation). A text model's update is large (10.7M
coordinates for the untied transformer3: a vmapped chunk of 256 gradients would be 11 GB), so the
simulator runs ``chunk_for`` batches at a time and every chunk is count-sketched (``CountSketch``,
Sec. 3.2) right away, parameter block by parameter block (``CountSketch.of_parts``: the rows are never
concatenated); only the hashed rows are kept. The inverter is the public LTI code's text network,
``Linear(d, hidden)-ReLU-Linear(hidden, B*L*token_hidden)-ReLU-View(B, L, token_hidden)-Linear(token_hidden,
V_out)`` (the paper: hidden 600, token_hidden 1000), trained with Adam on the per-position cross-entropy,
Hungarian-matched over the batch for B > 1 (cost: the mean cross-entropy of predicted sequence i against
target sequence j; ``matched_cross_entropy``), learning rate x0.1 at ``text_lr_drop_at`` of the epochs
(the public code: half of them). A held-out split of the auxiliary sequences measures the inverter's
token accuracy against the trivial guess (the most frequent training token at each position); it is
reported, nothing is selected with it.

Reconstruction: one forward pass, argmax per position, mapped back to the model's token ids.

Deviations and choices, stated:
- Output vocabulary: the output layer covers the tokens of the auxiliary data (their ids, and the
  targets of a causal LM), not the model's whole vocabulary (50,257 for GPT-2: 16 x 1000 x 50,257
  multiply-adds per sample and a 50M-parameter layer, for rows that cross-entropy training never makes
  an argmax, since no training target ever names them). A private token the auxiliary data lacks cannot
  be reconstructed either way; ``vocab_out`` in the preparation record says how many tokens are covered.
- Token rows (``token_rows``, on by default): when the model's token embedding is trained, its update
  has non-zero rows exactly for the tokens the batch feeds to a position with a target (every token of
  a classifier's batch; the first L - 1 of a causal LM's, whose last position has no target). Gupta et
  al. 2022 read the bag of tokens off it; the paper freezes the embedding so it does not arise. When the
  observed set S is informative (1 <= |S| <= B * L; a defense that noises every row, or FedAvg weight
  decay, makes it the whole vocabulary, and then it is not used) the argmax of those positions is taken
  over S only (over the output vocabulary when S and it do not meet). It reads the observation only.
  A defense that zeroes whole rows of a true token (pruning with a global scope can) makes S too small;
  ``token_rows=False`` turns it off, and the preparation record reports the held-out accuracy with and
  without it.
- Fresh defense draws: as for images, the training observations are redrawn every
  ``text_refresh_every`` epochs for a randomized defense (the paper: every minibatch). Each draw costs
  one gradient of the text model per auxiliary batch, which on a CPU dominates the preparation, so the
  quick budget draws once.
- Observations are standardised per coordinate (as the image path does); the paper feeds raw hashed
  gradients. Hashing is Weinberger's signed count-sketch over every trained parameter (the public code:
  unsigned, over the trainable parameters without the frozen tied embedding, the same set here).
- The public code keeps the epoch with the best test-set loss (the private data); we keep the final one.
  Its B > 1 path defends each sample's gradient and averages them; the simulator defends the batch's
  gradient, as a real client does.
- Cost (transformer3, 10.7M trained coordinates, B=1, L=16, two CPU cores shared with other jobs): one
  simulated update per auxiliary batch takes ~0.1 s without a defense or with sign compression when
  the cores are quiet (0.35-0.6 s when busy), ~0.15 s with Gaussian noise and 0.45-0.7 s with 99%
  pruning (the defense code's per-row work on 4.8M-entry layers); the tied transformer3 (1.0M) 0.03 s.
  So the simulation, not the inverter (~15 s at the quick budget), is most of a preparation: 1,500
  auxiliary windows took 155-165 s (none, sign) on quiet cores and up to 18 minutes (pruning, busy).
  The hashed training set itself is small (N x hash_dim float32).
"""

from __future__ import annotations

import time
from typing import Any, Callable, NamedTuple

import torch
import torch.nn.functional as F
from scipy.optimize import linear_sum_assignment
from torch import Tensor, nn

from guardfl.redteam.attacks.base import Reconstruction
from guardfl.redteam.attacks.labels import infer_labels
from guardfl.redteam.attacks.setting import Setting
from guardfl.redteam.client.hashing import CountSketch
from guardfl.redteam.attacks.learned.inverter_training import holdout_split, standardiser, train_inverter
from guardfl.redteam.client.transmit import TransmitSimulator, flatten_update
from guardfl.redteam.runtime.limits import MMAP_THRESHOLD
from guardfl.redteam.modality.text.models import next_token_labels
from guardfl.redteam.threat import ThreatModel

#: bytes of per-batch updates one vmapped chunk of the simulator may hold (the dim x 4 bytes rows)
CHUNK_BYTES = 256 * 2**20
#: the paper's hash ratio for the three-layer transformer (Sec. 4.2: 10% of its dimensions)
PAPER_HASH_RATIO = 0.1


def chunk_for(dim: int, largest: int = 0, device: torch.device | str = "cpu", limit: int = 256) -> int:
    """How many batches the simulator differentiates at once: ``chunk * dim * 4 bytes <= CHUNK_BYTES``,
    and on a CPU also ``chunk * largest * 4 bytes <= MMAP_THRESHOLD`` (``largest``: the largest parameter's
    entries). A chunk's gradient of one parameter is one block; above glibc's mmap threshold (32 MiB, the
    most it accepts, ``allocator.py``) every chunk gets it from fresh ``mmap`` pages and pays a page fault
    per 4 KiB. transformer3's token embedding is 4.8M entries (19 MB per batch), so its chunk is 1, not 6:
    192 aux batches, one thread, 2026-11-25: 8.8-9.8 s and 0.43M page faults, against 11.2-11.7 s and
    2.2M (vmapping 6 batches saves nothing there: the embedding and head gradients are memory-bound).
    A GPU's caching allocator reuses its blocks, so there only the first bound applies."""
    chunk = CHUNK_BYTES // (4 * dim)
    if torch.device(device).type == "cpu" and largest:
        chunk = min(chunk, MMAP_THRESHOLD // (4 * largest))
    return max(1, min(limit, chunk))


def is_causal(model: nn.Module) -> bool:
    return getattr(model, "task", None) == "causal-lm"


def text_refusal(setting: Setting, threat: ThreatModel) -> str | None:
    """Why the auxiliary data cannot train a token inverter for ``setting`` (None when it can)."""
    aux = threat.aux
    length = int(setting.input_shape[0]) if len(setting.input_shape) == 1 else None
    if length is None:
        return f"a text client sends sequences of shape (L,); this one {tuple(setting.input_shape)}"
    if aux.ood is not None and len(aux.ood):
        return "aux.ood (out-of-distribution images for LTI-OOD's DCT pseudo-images) has no token counterpart; give none"
    ids = aux.images
    if not len(ids) or ids.dtype != torch.long:
        return "needs auxiliary token ids (aux.images: int64 (N, L)) for a text client"
    if ids.dim() != 2 or ids.shape[1] != length:
        return f"auxiliary sequences have shape {tuple(ids.shape[1:])}, the client's ({length},)"
    vocab = int(setting.input_range[1]) + 1
    if int(ids.min()) < 0 or int(ids.max()) >= vocab:
        return f"auxiliary token ids must lie in [0, {vocab - 1}] (got {int(ids.min())}..{int(ids.max())})"
    labels = aux.labels
    want = (len(ids), length) if is_causal(setting.model) else (len(ids),)
    if tuple(labels.shape) != want:
        what = "next-token targets" if is_causal(setting.model) else "class labels"
        return f"auxiliary labels have shape {tuple(labels.shape)}; this client's {what} are {want}"
    valid = labels[labels != -100]
    if valid.numel() and (int(valid.min()) < 0 or int(valid.max()) >= setting.num_classes):
        return f"auxiliary labels must lie in [0, {setting.num_classes}) or be -100 (ignored)"
    if len(ids) < setting.num_samples:
        return f"{len(ids)} auxiliary sequences cannot fill one batch of {setting.num_samples}"
    return None


class TokenInverter(nn.Module):
    """The public LTI text network: ``Linear(d, hidden)-ReLU-Linear(hidden, B*L*token_hidden)-ReLU``, then
    per position ``Linear(token_hidden, vocab_out)``; returns logits ``(M, B, L, vocab_out)``."""

    def __init__(self, dim_in: int, hidden: int, token_hidden: int, batch: int, length: int, vocab_out: int) -> None:
        super().__init__()
        self.batch, self.length, self.token_hidden = batch, length, token_hidden
        self.body = nn.Sequential(nn.Linear(dim_in, hidden), nn.ReLU(),
                                  nn.Linear(hidden, batch * length * token_hidden), nn.ReLU())
        self.head = nn.Linear(token_hidden, vocab_out)

    def forward(self, features: Tensor) -> Tensor:
        h = self.body(features).view(features.shape[0], self.batch, self.length, self.token_hidden)
        return self.head(h)


def matched_cross_entropy(logits: Tensor, targets: Tensor, return_perm: bool = False):
    """The per-token cross-entropy of ``logits`` ``(M, B, L, V)`` against ``targets`` ``(M, B, L)`` (indices
    into V) under the best assignment of predicted to target sequences in each batch (Hungarian, scipy;
    cost: the mean cross-entropy of predicted sequence i vs target sequence j). B = 1: plain cross-entropy.
    ``return_perm``: also the assignment ``(M, B)`` (target row of each predicted row)."""
    m, b, length, v = logits.shape
    if b == 1:
        perm = torch.zeros(m, 1, dtype=torch.long, device=logits.device)
    else:
        with torch.no_grad():
            logp = logits.log_softmax(-1)
            index = targets[:, None, :, :, None].expand(m, b, b, length, 1)  # [m, i, j, l] = targets[m, j, l]
            cost = -logp[:, :, None].expand(m, b, b, length, v).gather(4, index).squeeze(4).mean(-1)
            perm = torch.stack([torch.as_tensor(linear_sum_assignment(c)[1]) for c in cost.cpu().numpy()]).to(logits.device)
        targets = targets[torch.arange(m, device=logits.device)[:, None], perm]
    loss = F.cross_entropy(logits.reshape(-1, v), targets.reshape(-1))
    return (loss, perm) if return_perm else loss


def group(ids: Tensor, labels: Tensor, batch: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """Random batches of ``batch`` sequences: ``(N, batch, L)`` and the labels ``(N, batch, ...)``."""
    order = torch.randperm(len(ids), generator=gen)
    n = len(ids) // batch
    idx = order[: n * batch].view(n, batch)
    return ids[idx], labels[idx]


def output_vocabulary(setting: Setting, threat: ThreatModel) -> Tensor:
    """The token ids the inverter can output (sorted): those of the auxiliary sequences, and a causal LM's
    auxiliary targets."""
    parts = [threat.aux.images.reshape(-1)]
    if is_causal(setting.model):
        labels = threat.aux.labels.reshape(-1)
        parts.append(labels[labels != -100])
    return torch.unique(torch.cat(parts))


def embedding_slice(setting: Setting) -> tuple[int, int, int] | None:
    """(offset, rows, width) of the trained token embedding in the flattened update, or None when the
    embedding is frozen (Wu et al.'s setting) or the model has none."""
    get = getattr(setting.model, "get_input_embeddings", None)
    if not callable(get):
        return None
    weight = get().weight
    offset = 0
    for name, p in setting.model.named_parameters():
        if not p.requires_grad:
            continue
        if p is weight:
            return offset, int(p.shape[0]), int(p.numel() // p.shape[0])
        offset += p.numel()
    return None


def token_rows(flat: Tensor, where: tuple[int, int, int] | None, limit: int) -> Tensor | None:
    """The token ids whose embedding rows are non-zero in the flattened update ``flat`` ``(D,)``; None when
    the embedding is not trained or the set is not informative (empty, or more than ``limit`` tokens: the
    defense or FedAvg's weight decay touched every row)."""
    if where is None:
        return None
    offset, rows, width = where
    ids = flat[offset : offset + rows * width].view(rows, width).ne(0).any(1).nonzero().flatten()
    return ids if 1 <= len(ids) <= limit else None


def allowed_outputs(rows: Tensor | None, lookup: Tensor, n: int) -> Tensor | None:
    """The mask over the ``n`` outputs of the token ids ``rows`` (``lookup``: token id -> output index, -1
    for tokens the inverter cannot output); None without rows."""
    if rows is None:
        return None
    known = lookup[rows.to(lookup.device)]
    allowed = torch.zeros(n, dtype=torch.bool, device=lookup.device)
    allowed[known[known >= 0]] = True
    return allowed


def restricted_argmax(logits: Tensor, allowed: Tensor | None, positions: int) -> Tensor:
    """Argmax over the last axis of ``logits`` ``(B, L, V)``; with ``allowed`` (a boolean ``(V,)`` mask that
    is not empty) the first ``positions`` positions choose among the allowed entries only."""
    if allowed is None or not bool(allowed.any()):
        return logits.argmax(-1)
    masked = logits.clone()
    masked[:, :positions][..., ~allowed] = float("-inf")
    return masked.argmax(-1)


def sketched_updates(sim: TransmitSimulator, ids: Tensor, labels: Tensor, sketch: CountSketch | None,
                     rows_of: tuple[int, int, int] | None = None, rows_limit: int = 0,
                     ) -> tuple[Tensor, list[Tensor | None]]:
    """What the client would transmit for each batch of ``ids`` ``(N, B, L)``, hashed as it is computed
    (``TransmitSimulator.updates``); with ``rows_of``, also each batch's informative token rows (then one
    chunk's full rows at a time: ``TransmitSimulator.chunks``)."""
    if rows_of is None:
        return sim.updates(ids, labels, sketch), []
    feats, rows = [], []
    for full in sim.chunks(ids, labels):  # the token rows are read off the full rows, then hashed
        rows.extend(token_rows(r, rows_of, rows_limit) for r in full)
        feats.append(sketch(full) if sketch is not None else full)
        del full
    return torch.cat(feats), rows


def token_positions(setting: Setting, length: int) -> int:
    """How many leading positions' tokens have embedding rows in the update: all L for a classifier, the
    first L - 1 for a causal LM (its last position has no target, so its token's row is untouched)."""
    return length - 1 if is_causal(setting.model) else length


def prepare_text(config, name: str, setting: Setting, threat: ThreatModel, device: torch.device,
                 gen: torch.Generator) -> dict[str, Any]:
    """Train the token inverter for ``setting`` (``LearnedInversion._prepare`` for a text client)."""
    c = config
    t0 = time.time()
    b, length = setting.num_samples, int(setting.input_shape[0])
    ids, labels = threat.aux.images, threat.aux.labels
    vocab = output_vocabulary(setting, threat)
    lookup = torch.full((int(setting.input_range[1]) + 1,), -1, dtype=torch.long)
    lookup[vocab] = torch.arange(len(vocab))
    val_idx, train_idx = holdout_split(len(ids), c.holdout, b, gen, "sequences")
    defense = setting.defense_config if threat.defense == "known" else None
    trained = [p.numel() for p in setting.model.parameters() if p.requires_grad]
    dim, largest = sum(trained), max(trained)
    sim = TransmitSimulator(setting.model, defense, setting.protocol, train_mode=setting.train_mode, device=device,
                            chunk=chunk_for(dim, largest, device), seed=int(torch.randint(0, 2**62, (1,), generator=gen)))
    random_defense = sim.defense is not None and sim.defense.randomized
    hash_dim = text_hash_dim(c.text_hash_dim, c.hash_dim, c.hash_ratio, dim)
    sketch = CountSketch(dim, hash_dim, seed=int(torch.randint(0, 2**62, (1,), generator=gen))) if hash_dim < dim else None
    rows_of = embedding_slice(setting)

    simulated = [0.0]

    def draw(idx: Tensor, with_rows: bool = False) -> tuple[Tensor, Tensor, list]:
        t = time.time()
        x, y = group(ids[idx], labels[idx], b, gen)
        feats, rows = sketched_updates(sim, x, y, sketch, rows_of if with_rows else None, b * length)
        simulated[0] += time.time() - t
        return feats.to(device), lookup[x].to(device), rows

    feats, targets, _ = draw(train_idx)
    mu, sd = standardiser(feats, c.standardize)
    dims = (feats.shape[1], c.text_hidden, c.token_hidden, b, length, len(vocab))
    with torch.random.fork_rng(devices=[]):  # init from the attack's generator, the global RNG untouched
        torch.manual_seed(int(torch.randint(0, 2**62, (1,), generator=gen)))
        net = TokenInverter(*dims).to(device)
    redraw = (lambda: draw(train_idx)[:2]) if random_defense else None
    losses, draws = train_inverter(net, feats, targets, matched_cross_entropy, redraw, mu=mu, sd=sd,
                                   epochs=c.text_epochs, batch=c.text_batch, lr=c.text_lr,
                                   lr_drop_at=c.text_lr_drop_at, refresh_every=c.text_refresh_every, gen=gen,
                                   progress=c.progress, name=name, metric="ce")
    train_ids = ids[train_idx]
    trivial = torch.mode(train_ids, 0).values  # the most frequent training token at each position
    info: dict[str, Any] = {
        "aux_sequences": len(ids), "train_batches": int(len(train_idx) // b), "sequence_length": length,
        "vocab_out": len(vocab), "hidden": c.text_hidden, "token_hidden": c.token_hidden, "input_dim": dim,
        "hash_dim": sketch.dim_out if sketch else None, "simulator_chunk": sim.chunk, "epochs": c.text_epochs,
        "final_train_ce": losses[-1], "defense_augmentation": defense is not None, "fresh_draws": draws > 1,
        "draws": draws,
        "token_rows": rows_of is not None,  # the token embedding is trained: its rows name the batch's tokens
    }
    if len(val_idx) >= b:
        info.update(_text_holdout(net, draw, val_idx, mu, sd, vocab, lookup, trivial,
                                  token_positions(setting, length) if info["token_rows"] else None, device))
    info["simulate_seconds"] = simulated[0]  # the client's updates for the auxiliary batches (most of it)
    info["train_seconds"] = time.time() - t0
    return {"modality": "text", "net": {k: v.cpu() for k, v in net.state_dict().items()}, "dims": dims,
            "vocab": vocab, "mu": mu.cpu(), "sd": sd.cpu(), "sketch": sketch.spec() if sketch else None,
            "rows_of": rows_of, "info": info}


def text_hash_dim(text_hash_dim: int | None, hash_dim: int | None, hash_ratio: float | None, dim: int) -> int:
    """The hashed dimension of a text client's ``dim``-long update: ``text_hash_dim``, else ``hash_dim``
    (at most ``dim``), else ``dim`` times ``hash_ratio`` (default ``PAPER_HASH_RATIO``)."""
    if text_hash_dim is not None or hash_dim is not None:
        return min(dim, text_hash_dim if text_hash_dim is not None else hash_dim)
    return max(1, int(dim * (hash_ratio if hash_ratio is not None else PAPER_HASH_RATIO)))


def _text_holdout(net: nn.Module, draw: Callable[..., tuple[Tensor, Tensor, list]], val_idx: Tensor, mu: Tensor,
                  sd: Tensor, vocab: Tensor, lookup: Tensor, trivial: Tensor, positions: int | None,
                  device: torch.device) -> dict[str, float]:
    """The trained token inverter on the held-out batches (``draw(val_idx)``: features, target token
    indices, each batch's embedding rows): matched cross-entropy and token accuracy, the accuracy of the
    most frequent training token per position (``trivial``), and with ``positions`` (token rows read) the
    accuracy of the answer restricted to the rows' tokens."""
    out: dict[str, float] = {}
    net.eval()
    with torch.no_grad():
        vf, vt, vrows = draw(val_idx, with_rows=True)
        logits = net((vf - mu) / sd)
        ce, perm = matched_cross_entropy(logits, vt, return_perm=True)
        matched = vt[torch.arange(len(vt), device=device)[:, None], perm]
        out["holdout_ce"] = float(ce)
        out["holdout_token_accuracy"] = float((logits.argmax(-1) == matched).float().mean())
        truth = vocab.to(device)[vt]
        out["holdout_token_accuracy_trivial"] = float((truth == trivial.to(device)).float().mean())
        if positions is not None:
            picks, used = [], 0
            for lg, r in zip(logits, vrows):
                used += r is not None
                picks.append(restricted_argmax(lg, allowed_outputs(r, lookup.to(device), len(vocab)), positions))
            out["holdout_token_accuracy_rows"] = float((torch.stack(picks) == matched).float().mean())
            out["holdout_rows_informative"] = used / max(1, len(vrows))
    return out


def invert_text(config, state: dict[str, Any], observations: list, knowledges: list, device: torch.device,
                ) -> list[Reconstruction]:
    """The token inverter's answer for observations of the prepared text setting (on ``device``): each
    update flattened and hashed one at a time (a 10.7M-coordinate row each), one forward for all."""
    setting = Setting.of(observations[0])
    net = TokenInverter(*state["dims"]).to(device)
    net.load_state_dict(state["net"])
    net.eval()
    vocab = state["vocab"].to(device)
    sketch = CountSketch(**state["sketch"]) if state["sketch"] is not None else None
    rows_of = tuple(state["rows_of"]) if (config.token_rows and state["rows_of"] is not None) else None
    b, length = state["dims"][3], state["dims"][4]
    lookup = torch.full((int(setting.input_range[1]) + 1,), -1, dtype=torch.long, device=device)
    lookup[vocab] = torch.arange(len(vocab), device=device)
    feats, alloweds = [], []
    for o in observations:
        flat = flatten_update(o.update, setting.param_names).to(device)
        alloweds.append(allowed_outputs(token_rows(flat, rows_of, b * length), lookup, len(vocab)))
        feats.append(sketch(flat[None]) if sketch is not None else flat[None])
        del flat
    with torch.no_grad():
        logits = net((torch.cat(feats) - state["mu"].to(device)) / state["sd"].to(device))
    info = state["info"]
    objective = float(info.get("holdout_ce", info["final_train_ce"]))
    positions = token_positions(setting, length)
    out = []
    for i, (o, k) in enumerate(zip(observations, knowledges)):
        tokens = vocab[restricted_argmax(logits[i], alloweds[i], positions)]
        if k.labels is not None:
            labels, source = k.labels, "known"
        elif is_causal(setting.model):
            labels, source = next_token_labels(tokens), "next tokens of the reconstruction"
        else:
            labels, source = infer_labels(o).to(device), "inferred"
        out.append(Reconstruction(tokens, labels, objective, [objective], {
            "labels": source, "token_rows": alloweds[i] is not None,
            "objective": "the inverter's held-out auxiliary cross-entropy per token (no private data)"}))
    return out


class TextMaths(NamedTuple):
    """The attack's maths for a modality other than images: refusal, preparation, inversion."""

    refusal: Any
    prepare: Any
    invert: Any


#: the learned-inversion maths by ``Setting.modality`` for token-id clients (images: ``LearnedInversion``'s own)
TEXT_MATHS = {"text": TextMaths(text_refusal, prepare_text, invert_text)}
