"""How much of the private text came back: token and ROUGE metrics after one-to-one matching.

``evaluate_text(recon, truth, tokenizer)`` compares reconstructed token rows with the true ones with the
measures text gradient-inversion work reports (ROUGE-1/2/L as in TAG and LAMP; breaching adds token
accuracy), per sample and in summary. For a batch (B > 1) the reconstructions are first matched to the
true rows with the Hungarian algorithm (:func:`match_sequences`, most matching positions), as the image
metrics match on MSE (``guardfl.redteam.modality.image.metrics``); each row reports its ``matched`` reconstruction.

Per sample (``per_image``, the key name the rest of the red team reads):

* ``token_acc``: the fraction of positions where the reconstructed id equals the true id.
* ``bag``: the share of the private tokens recovered as a bag of words: multiset recall
  ``|recon ∩ truth| / |truth|`` over token ids (order ignored: what leaks when an attack learns which tokens
  were used but not where, as the embedding layer's gradient rows give away and LAMP exploits).
* ``rouge1``, ``rouge2``, ``rougeL``: F-measures of the ``rouge-score`` package (``RougeScorer``, no
  stemmer) on the decoded strings, which is what the papers report. Choice: rouge-score's own word
  tokenizer keeps only ``[a-z0-9]`` runs after lower-casing, so a non-English sample would score 0 however
  well it came back (a false "safe"). It is swapped for the same rule on Unicode letters and digits
  (lower-case, split on runs of anything else), identical to rouge-score's on ASCII text. ROUGE-n is None for
  a sample whose true text has fewer than n words (ROUGE-1 and -L: no words, only punctuation, spaces or
  special tokens; ROUGE-2: one word): there is no n-gram to recover, and rouge-score's 0 would read as
  "nothing leaked"; the token metrics still measure such a sample.
* ``text`` / ``recon_text``: the decoded strings.

``ignore_ids`` (for instance the padding id of classification rows) are left out everywhere: positions
whose true id is ignored do not count in ``token_acc`` or in the matching, ignored ids are not tokens of
either bag, and they are removed before decoding. A sample with nothing left reports None.

``summary``: per metric ``mean``, ``max``, ``min``, and ``best`` / ``worst`` as in the image metrics (every
text metric grows with leakage, so ``best`` = ``max``: the worst case for privacy).
"""

from __future__ import annotations

import re
import warnings
from collections import Counter
from functools import lru_cache
from typing import Any, Iterable

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment
from torch import Tensor

ROUGE_TYPES = ("rouge1", "rouge2", "rougeL")
METRICS = ("token_acc", "bag", *ROUGE_TYPES)
#: metric -> True when a higher value means more leakage
HIGHER_LEAKS = {m: True for m in METRICS}
#: a ROUGE score is None when the true text has fewer words than this (no n-gram to recover)
_MIN_WORDS = {"rouge1": 1, "rouge2": 2, "rougeL": 1}
_NON_WORD = re.compile(r"[\W_]+")


class _UnicodeWords:
    """rouge-score's word tokenizer (lower-case, replace runs of non-alphanumerics by spaces, split) on
    Unicode letters and digits instead of ``[a-z0-9]``."""

    def tokenize(self, text: str) -> list[str]:
        return _NON_WORD.sub(" ", text.lower()).split()


@lru_cache(maxsize=1)
def _scorer():
    with warnings.catch_warnings():  # rouge-score imports nltk and absl: their import-time warnings are not ours
        warnings.simplefilter("ignore")
        from rouge_score import rouge_scorer
    return rouge_scorer.RougeScorer(list(ROUGE_TYPES), use_stemmer=False, tokenizer=_UnicodeWords())


def _check(recon: Tensor, truth: Tensor) -> tuple[Tensor, Tensor]:
    recon, truth = torch.as_tensor(recon), torch.as_tensor(truth)
    if recon.dim() != 2 or recon.shape != truth.shape:
        raise ValueError(f"reconstruction shape {tuple(recon.shape)} differs from the truth's {tuple(truth.shape)} "
                         "(both must be (B, L) token ids)")
    return recon.detach().long().cpu(), truth.detach().long().cpu()


def _keep_mask(truth: Tensor, ignore_ids: Iterable[int]) -> Tensor:
    ignore = torch.tensor(sorted({int(i) for i in ignore_ids}), dtype=torch.long)
    return ~torch.isin(truth, ignore) if ignore.numel() else torch.ones_like(truth, dtype=torch.bool)


def match_sequences(recon: Tensor, truth: Tensor, *, ignore_ids: Iterable[int] = ()) -> np.ndarray:
    """``perm`` with ``recon[perm[i]]`` matched to ``truth[i]``: the Hungarian assignment (scipy's
    ``linear_sum_assignment``) with the most rows recovered exactly (every counted position right), then the
    most positions where the ids agree in total (positions whose true id is in ``ignore_ids`` do not count).
    Among equally good assignments, the one keeping the most rows in place is taken, so an unpermuted batch
    stays unpermuted. (Agreement alone never does better by handing an exact reconstruction to another row,
    but a tie could, and the tie-break would take it: the exact rows come first, as the image metrics'.)"""
    recon, truth = _check(recon, truth)
    b = truth.shape[0]
    if b <= 1:
        return np.arange(b)
    keep = _keep_mask(truth, ignore_ids)
    agree = torch.empty(b, b, dtype=torch.float64)  # [truth i, recon j]: positions that agree
    step = max(1, (1 << 24) // max(1, b * truth.shape[1]))  # rows at a time: bounded memory for large batches
    for i in range(0, b, step):
        agree[i:i + step] = ((truth[i:i + step, None, :] == recon[None, :, :]) & keep[i:i + step, None, :]).sum(-1)
    exact = (agree == keep.sum(1, keepdim=True)).to(torch.float64)  # every counted position of truth row i
    tiers = (b + 1) * (b * truth.shape[1] + 1)  # more than any difference of the agreement term and the tie-break
    cost = -exact * tiers - agree * (b + 1) + (1 - torch.eye(b, dtype=torch.float64))  # exact, agreement, staying put
    _, cols = linear_sum_assignment(cost.numpy())
    return cols


def _bag_recall(recon: list[int], truth: list[int]) -> float | None:
    if not truth:
        return None
    common = Counter(recon) & Counter(truth)
    return sum(common.values()) / len(truth)


def _summary(per_image: list[dict[str, Any]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for key in METRICS:
        values = [r[key] for r in per_image if r.get(key) is not None]
        if not values:
            summary[key] = None
            continue
        hi, lo = float(max(values)), float(min(values))
        summary[key] = {"mean": float(np.mean(values)), "max": hi, "min": lo, "best": hi, "worst": lo}
    return summary


def evaluate_text(recon: Tensor, truth: Tensor, tokenizer, *, ignore_ids: Iterable[int] = ()) -> dict[str, Any]:
    """Per-sample and summary text metrics of ``recon`` ``(B, L)`` against ``truth`` ``(B, L)`` (token ids;
    see the module docstring). Rows are matched first when B > 1; ``per_image[i]`` is true row ``i`` with
    its ``matched`` reconstruction row."""
    recon, truth = _check(recon, truth)
    ignore_ids = tuple(int(i) for i in ignore_ids)
    perm = match_sequences(recon, truth, ignore_ids=ignore_ids)
    recon = recon[torch.as_tensor(perm, dtype=torch.long)]
    keep = _keep_mask(truth, ignore_ids)
    recon_keep = _keep_mask(recon, ignore_ids)
    scorer = _scorer() if truth.shape[0] else None
    per_image: list[dict[str, Any]] = []
    for i in range(truth.shape[0]):
        t_ids = truth[i][keep[i]].tolist()
        r_ids = recon[i][recon_keep[i]].tolist()
        n = int(keep[i].sum())
        text, recon_text = tokenizer.decode(t_ids), tokenizer.decode(r_ids)
        row: dict[str, Any] = {
            "index": i,
            "matched": int(perm[i]),
            "token_acc": float(((recon[i] == truth[i]) & keep[i]).sum()) / n if n else None,
            "bag": _bag_recall(r_ids, t_ids),
        }
        words = len(_UnicodeWords().tokenize(text))
        scores = scorer.score(text, recon_text) if words else {}
        for key in ROUGE_TYPES:
            row[key] = float(scores[key].fmeasure) if words >= _MIN_WORDS[key] else None
        row["text"], row["recon_text"] = text, recon_text
        per_image.append(row)
    return {
        "per_image": per_image,
        "summary": _summary(per_image),
        "notes": "best = the worst case for privacy (most leakage); matching: Hungarian on token agreement; "
                 "ROUGE: rouge-score F-measure on decoded text, no stemmer, Unicode words",
    }


def evaluate_reconstruction(reconstruction, inputs: Tensor, labels: Tensor | None, *, tokenizer: str,
                            **_image: object) -> dict[str, Any]:
    """A text client's measure of a reconstruction (a ``Reconstruction`` or token ids; one row: the same
    guess for every sample, the prior): :func:`evaluate_text` with the tokenizer named ``tokenizer`` and,
    for a classifier, the restored labels' accuracy (``label_correct``, ``summary["label_acc"]``). A
    classifier's sentences are padded with end-of-text: padding is no private token. The image options
    (``input_range``, ``lpips_weights``) are not text's."""
    from guardfl.redteam.modality.text.tokenizer import load_tokenizer

    recon = reconstruction.inputs if hasattr(reconstruction, "inputs") else reconstruction
    if recon.dim() == 1:  # one guess for every sample (the prior)
        recon = recon.expand_as(inputs)
    tok = load_tokenizer(tokenizer)
    classifier = labels is not None and labels.dim() == 1
    ignore = (tok.eos_id,) if classifier and tok.eos_id is not None else ()
    m = evaluate_text(recon.cpu(), inputs.cpu(), tok, ignore_ids=ignore)
    rec_labels = getattr(reconstruction, "labels", None)
    if rec_labels is not None and classifier:
        rl = rec_labels.detach().cpu().reshape(-1)
        for row in m["per_image"]:
            j = row.get("matched", row["index"])
            row["label_correct"] = bool(rl[j] == labels[row["index"]]) if j < len(rl) else False
        m["summary"]["label_acc"] = sum(r["label_correct"] for r in m["per_image"]) / max(1, len(m["per_image"]))
    return m
