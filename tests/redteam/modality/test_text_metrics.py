"""Text leakage metrics: token accuracy, bag-of-tokens recall and ROUGE after Hungarian matching."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from guardfl.redteam.modality.text import metrics as textmetrics
from guardfl.redteam.modality.text.metrics import evaluate_text, match_sequences
from guardfl.redteam.modality.text.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def gpt2():
    return load_tokenizer("gpt2")


@pytest.fixture(scope="module")
def batch(gpt2):
    texts = ["The cat sat on the mat today.", "A private note about money!!", "Meet me at noon by the river.",
             "Passwords are stored in plain text."]
    return torch.tensor([(gpt2.encode(t) + [gpt2.eos_id] * 8)[:8] for t in texts])


def test_a_perfect_reconstruction_scores_one_everywhere(gpt2, batch):
    out = evaluate_text(batch.clone(), batch, gpt2)
    assert [r["index"] for r in out["per_image"]] == [r["matched"] for r in out["per_image"]] == [0, 1, 2, 3]
    for key in textmetrics.METRICS:
        assert out["summary"][key] == {"mean": 1.0, "max": 1.0, "min": 1.0, "best": 1.0, "worst": 1.0}
    row = out["per_image"][0]
    assert set(row) == {"index", "matched", "token_acc", "bag", "rouge1", "rouge2", "rougeL", "text", "recon_text"}
    assert row["text"] == row["recon_text"] == gpt2.decode(batch[0])


def test_matching_undoes_a_permutation(gpt2, batch):
    out = evaluate_text(batch[[2, 0, 3, 1]], batch, gpt2)
    assert [r["matched"] for r in out["per_image"]] == [1, 3, 0, 2]
    assert out["summary"]["token_acc"]["min"] == 1.0
    assert list(match_sequences(batch[[2, 0, 3, 1]], batch)) == [1, 3, 0, 2]


@settings(max_examples=40, deadline=None)
@given(b=st.integers(1, 6), length=st.integers(2, 10), seed=st.integers(0, 2**16))
def test_token_acc_of_a_permuted_batch_is_one_after_matching(b, length, seed):
    g = torch.Generator().manual_seed(seed)
    truth = torch.randint(0, 5, (b, length), generator=g)  # small vocabulary: rows may tie or repeat
    perm = torch.randperm(b, generator=g)
    recon = truth[perm]
    cols = match_sequences(recon, truth)
    assert sorted(cols.tolist()) == list(range(b))
    assert torch.equal(recon[torch.as_tensor(cols)], truth)
    if len({tuple(r) for r in truth.tolist()}) == b and b > 1:  # distinct rows: the permutation itself
        assert torch.equal(perm[torch.as_tensor(cols)], torch.arange(b))


def test_matching_keeps_an_unpermuted_batch_in_place_on_ties():
    truth = torch.tensor([[1, 2], [3, 4], [5, 6]])
    recon = torch.tensor([[9, 9], [9, 9], [9, 9]])  # nothing agrees: every assignment ties
    assert match_sequences(recon, truth).tolist() == [0, 1, 2]


def test_token_acc_and_bag(gpt2):
    truth = torch.tensor([[10, 11, 12, 13]])
    out = evaluate_text(torch.tensor([[10, 11, 99, 99]]), truth, gpt2)["per_image"][0]
    assert out["token_acc"] == 0.5 and out["bag"] == 0.5
    out = evaluate_text(torch.tensor([[13, 12, 11, 10]]), truth, gpt2)["per_image"][0]
    assert out["token_acc"] == 0.0 and out["bag"] == 1.0  # every token recovered, none in place
    out = evaluate_text(torch.tensor([[10, 10, 10, 10]]), torch.tensor([[10, 10, 11, 12]]), gpt2)["per_image"][0]
    assert out["bag"] == 0.5  # a multiset: two 10s to recover, not four


def test_rouge_is_scored_on_the_decoded_text(gpt2):
    truth = torch.tensor([gpt2.encode(" the cat sat on the mat")])
    recon = torch.tensor([gpt2.encode(" the mat sat on the cat")])
    row = evaluate_text(recon, truth, gpt2)["per_image"][0]
    assert row["rouge1"] == pytest.approx(1.0) and row["rouge2"] == pytest.approx(0.8) and row["rougeL"] == pytest.approx(4 / 6)
    assert row["token_acc"] == pytest.approx(4 / 6)


@settings(max_examples=40, deadline=None)
@given(text=st.text(min_size=1, max_size=40))
def test_rouge_of_identical_texts_is_one(gpt2, text):
    ids = torch.tensor([gpt2.encode(text)])
    row = evaluate_text(ids, ids, gpt2)["per_image"][0]
    assert row["token_acc"] == row["bag"] == 1.0
    words = len(textmetrics._UnicodeWords().tokenize(text))
    assert row["rouge1"] == row["rougeL"] == (1.0 if words else None)  # no words: ROUGE measures nothing
    assert row["rouge2"] == (1.0 if words >= 2 else None)  # one word: no bigram


@settings(max_examples=60, deadline=None)
@given(a=st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=40),
       b=st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=40))
def test_rouge_words_are_rouge_scores_own_on_ascii(a, b):
    from rouge_score import tokenize

    assert textmetrics._UnicodeWords().tokenize(a) == tokenize.tokenize(a, None)
    assert textmetrics._UnicodeWords().tokenize(b) == tokenize.tokenize(b, None)


def test_non_ascii_text_is_not_scored_zero(gpt2):
    ids = torch.tensor([gpt2.encode("Größe über alles, 日本語 テキスト")])
    row = evaluate_text(ids, ids, gpt2)["per_image"][0]
    assert row["rouge1"] == row["rougeL"] == 1.0


def test_ignored_ids_do_not_count(gpt2):
    eos = gpt2.eos_id
    truth = torch.tensor([gpt2.encode(" good morning") + [eos] * 4])
    recon = torch.tensor([gpt2.encode(" good evening") + [7, 7, eos, eos]])
    plain = evaluate_text(recon, truth, gpt2)["per_image"][0]
    padded = evaluate_text(recon, truth, gpt2, ignore_ids=[eos])["per_image"][0]
    assert plain["token_acc"] == pytest.approx(3 / 6) and padded["token_acc"] == pytest.approx(1 / 2)
    assert padded["bag"] == pytest.approx(1 / 2) and padded["text"] == " good morning"
    assert padded["recon_text"] == " good evening" + gpt2.decode([7, 7])
    only_padding = evaluate_text(truth[:, 2:], truth[:, 2:], gpt2, ignore_ids=[eos])
    row = only_padding["per_image"][0]
    assert row["token_acc"] is row["bag"] is row["rouge1"] is None and only_padding["summary"]["token_acc"] is None


def test_summary_is_mean_and_extremes(gpt2, batch):
    recon = batch.clone()
    recon[1, 4:] = 0  # half of row 1 wrong
    out = evaluate_text(recon, batch, gpt2)
    acc = out["summary"]["token_acc"]
    assert acc["max"] == acc["best"] == 1.0 and acc["min"] == acc["worst"] == 0.5 and acc["mean"] == pytest.approx(0.875)
    assert out["per_image"][1]["token_acc"] == 0.5 and "Hungarian" in out["notes"]


def test_shapes_must_agree(gpt2, batch):
    with pytest.raises(ValueError, match="shape"):
        evaluate_text(batch[:2], batch[:3], gpt2)
    with pytest.raises(ValueError, match="shape"):
        evaluate_text(batch[0], batch[0], gpt2)


def test_match_of_one_row_and_of_arrays(batch):
    assert match_sequences(batch[:1], batch[:1]).tolist() == [0]
    assert isinstance(match_sequences(np.asarray(batch[[1, 0]]), np.asarray(batch[:2])), np.ndarray)


def test_matching_keeps_an_exact_row_that_a_tie_would_hand_away():
    """Row 0's reconstruction sits at index 1 and is exact; swapping it with the other reconstruction gives
    the same total agreement and keeps both rows in place, which the tie-break alone would prefer."""
    truth = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 5]])
    recon = torch.tensor([[9, 9, 9, 4], [1, 2, 3, 4]])  # recon 1 == truth 0; in place: 1 + 3 agree, swapped: 4 + 0
    perm = match_sequences(recon, truth)
    assert list(perm) == [1, 0]
