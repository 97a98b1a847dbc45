"""What a text model's embedding gradients give away, as pure functions (no model, no attack state).

A transformer adds a token embedding and a learned position embedding, ``h[b, p] = E[x[b, p]] + P[p]``,
so with ``g[b, p] = dL/dh[b, p]`` the two transmitted gradients are sums of the same vectors:

    dL/dE[v] = sum of g[b, p] over the occurrences (b, p) of token v in the batch
    dL/dP[p] = sum of g[b, p] over the batch

- ``token_bag``: the rows of ``dL/dE`` that are non-zero are the batch's tokens (Gupta et al. 2022, LAMP;
  Wu et al. 2023, Sec. 4.2).
- ``assign_positions`` (one sequence): a token seen once has ``dL/dE[v] = dL/dP[p]`` for its position
  exactly, a repeated one the sum of its positions' rows; so the token rows are the position rows times a
  0/1 assignment, ``R = A Q``, and with no more positions than the embedding's width the least-squares
  ``A = R Q^+`` is that assignment (the readout step of Fowl et al. 2022, "Decepticons", here on what an
  honest server receives).
- ``position_sets`` (B sequences): each position's row is the sum of the B tokens there, so a greedy
  orthogonal matching pursuit over the bag's rows picks B tokens per position.
- ``order_sequences``: which of a position's B tokens continues which sequence is not in these two
  gradients; an auxiliary-text bigram model decides (a linear assignment per position, as LAMP uses a
  language model to order tokens). Without auxiliary text the order within a position is arbitrary.
"""

from __future__ import annotations

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment
from torch import Tensor


def token_bag(rows: Tensor, most: int) -> Tensor | None:
    """The token ids whose embedding-gradient rows carry the batch: the non-zero rows when they are few
    (at most half the vocabulary: no defense, pruning, sign), else the rows whose norm stands out from the
    bulk (robust z-score > 6 with median and MAD; noise makes every row non-zero), at most ``most`` of
    them, largest first. None when nothing stands out."""
    norms = rows.detach().float().norm(dim=1)
    nonzero = (norms > 0).nonzero().flatten()
    if 0 < len(nonzero) <= rows.shape[0] // 2:
        return nonzero
    med = norms.median()
    mad = (norms - med).abs().median().clamp(min=1e-30)
    z = (norms - med) / (1.4826 * mad)
    picked = (z > 6).nonzero().flatten()
    if not len(picked):
        return None
    return picked[norms[picked].argsort(descending=True)[:most]].sort().values


def _unit(rows: Tensor) -> Tensor:
    return rows / rows.norm(dim=1, keepdim=True).clamp(min=1e-30)


def assign_positions(token_rows: Tensor, position_rows: Tensor) -> Tensor:
    """One sequence: per position, the index (into ``token_rows``, k x D) of its token, -1 where the
    position's row is zero (a causal LM's last position; a position pruned away). ``position_rows`` is
    L x D. Least squares ``R = A Q`` over the non-zero positions when they number at most D (exact for an
    undefended update); cosine similarity otherwise, and where the least-squares coefficients are
    ill-posed (a rank-deficient Q). Position rows with exact zeros inside (pruned: the zeros are missing
    values, not values) are compared on their surviving coordinates only (a masked cosine): pruning per
    layer keeps a sparse embedding's few non-zero rows whole but cuts the dense position rows, whose
    surviving coordinates equal the token row's there."""
    r, q = token_rows.double(), position_rows.double()
    active = (q.norm(dim=1) > 0).nonzero().flatten()
    out = torch.full((q.shape[0],), -1, dtype=torch.long)
    if not len(active) or not len(r):
        return out
    qa = q[active]
    if bool((qa == 0).any()):
        mask = (qa != 0).double()  # (La, D)
        dots = r @ qa.T  # zeros of qa drop out of the product by themselves
        r_norms = (r.pow(2) @ mask.T).sqrt()  # each token row's norm on each position's coordinates
        scores = dots / (r_norms * qa.norm(dim=1)).clamp(min=1e-30)
    elif len(active) <= q.shape[1] and torch.linalg.matrix_rank(qa) == len(active):
        scores = r @ torch.linalg.pinv(qa)  # (k, La): the assignment's least-squares coefficients
    else:
        scores = _unit(r) @ _unit(qa).T
    out[active] = scores.argmax(0)
    return out


def position_sets(token_rows: Tensor, position_rows: Tensor, batch: int) -> list[list[int]]:
    """B sequences: per position, ``batch`` indices into ``token_rows`` whose rows best sum to the
    position's row (orthogonal matching pursuit: the most correlated unit row, then a least-squares refit
    of the chosen rows and the residual, ``batch`` times; distinct picks). An empty list where the
    position's row is zero."""
    r = token_rows.double()
    unit = _unit(r)
    sets: list[list[int]] = []
    for row in position_rows.double():
        if not float(row.norm()) or not len(r):
            sets.append([])
            continue
        chosen: list[int] = []
        residual = row
        for _ in range(min(batch, len(r))):
            corr = unit @ residual
            if chosen:
                corr[chosen] = -float("inf")
            chosen.append(int(corr.argmax()))
            basis = r[chosen].T
            coef = torch.linalg.lstsq(basis, row.unsqueeze(1)).solution
            residual = row - (basis @ coef).squeeze(1)
        sets.append(chosen)
    return sets


class Bigram:
    """A bigram model of auxiliary token sequences (N, L): ``logp(prev, nxt)`` = log P(nxt | prev) with
    add-``alpha`` smoothing towards the unigram distribution (itself add-one over the vocabulary);
    ``best_next(prev)`` the most likely follower (the most frequent token when ``prev`` was never seen)."""

    def __init__(self, sequences: Tensor, vocab: int, alpha: float = 1.0) -> None:
        seq = sequences.long().cpu()
        self.vocab, self.alpha = vocab, alpha
        uni = torch.bincount(seq.flatten(), minlength=vocab).double()
        self.unigram = (uni + 1) / (uni.sum() + vocab)
        pairs = (seq[:, :-1] * vocab + seq[:, 1:]).flatten()
        keys, counts = torch.unique(pairs, return_counts=True)
        self.pairs = dict(zip(keys.tolist(), counts.tolist()))
        self.prev_counts = torch.bincount(seq[:, :-1].flatten(), minlength=vocab).double()
        followers: dict[int, tuple[int, int]] = {}
        for key, count in self.pairs.items():
            prev, nxt = divmod(key, vocab)
            if prev not in followers or count > followers[prev][1]:
                followers[prev] = (nxt, count)
        self.followers = {prev: nxt for prev, (nxt, _) in followers.items()}
        self.most_frequent = int(uni.argmax())

    def logp(self, prev: int, nxt: int) -> float:
        c = self.pairs.get(prev * self.vocab + nxt, 0)
        return float(np.log((c + self.alpha * float(self.unigram[nxt])) / (float(self.prev_counts[prev]) + self.alpha)))

    def best_next(self, prev: int) -> int:
        return self.followers.get(prev, self.most_frequent)


def order_sequences(sets: list[list[int]], batch: int, bigram: Bigram | None, fill: int) -> Tensor:
    """(B, L) token ids from per-position token sets (token ids, at most B each): position 0 in the set's
    order; each later position's tokens assigned to the sequences by a linear assignment maximising the
    bigram log-probability of following each sequence's previous token (in the set's order without a
    bigram model). A position with fewer than B tokens (a zero or pruned row) is filled with the bigram's
    most likely follower, else ``fill``."""
    length = len(sets)
    out = torch.full((batch, length), fill, dtype=torch.long)
    for p, tokens in enumerate(sets):
        tokens = list(tokens)[:batch]
        rows = list(range(batch))
        if p and bigram is not None and tokens:
            prev = out[:, p - 1].tolist()
            score = np.array([[bigram.logp(a, t) for t in tokens] for a in prev])
            rows, cols = linear_sum_assignment(-score)
            tokens = [tokens[c] for c in cols]
            rows = list(rows)
        for b, t in zip(rows, tokens):
            out[b, p] = t
        if len(tokens) < batch:
            taken = set(rows[: len(tokens)])
            for b in range(batch):
                if b not in taken:
                    out[b, p] = bigram.best_next(int(out[b, p - 1])) if (bigram is not None and p) else fill
    return out
