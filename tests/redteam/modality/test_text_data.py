"""Text data for the red team: sources (built in, files, folders, labelled TSVs, cached `datasets`) and
their cutting into fixed-length token rows."""

from __future__ import annotations

import os
import sys
import types

import pytest
import torch
from hypothesis import given, settings, strategies as st

from guardfl.errors import ConfigError
from guardfl.redteam.modality.text import data as textdata
from guardfl.redteam.modality.text.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def gpt2():
    return load_tokenizer("gpt2")


def one_line_error(field: str, fn, *args, **kwargs) -> str:
    with pytest.raises(ConfigError) as err:
        fn(*args, **kwargs)
    text = str(err.value)
    assert text.startswith(f"{field}: ") and "\n" not in text, text
    return text


def windows(ids: list[int], seq_len: int) -> list[list[int]]:
    """Reference: consecutive windows, repeats dropped."""
    out: list[list[int]] = []
    for i in range(0, len(ids) - seq_len + 1, seq_len):
        if ids[i:i + seq_len] not in out:
            out.append(ids[i:i + seq_len])
    return out


# ----------------------------------------------------------------------------------------------- sources
def test_builtin_text_is_english_prose_without_download():
    text = textdata.builtin_text()
    assert len(text) > 100_000 and text.startswith('The "assert" statement')
    assert "statement" in text and text == textdata.load_text(None)


def test_a_file_is_its_utf8_text(tmp_path):
    path = tmp_path / "private.txt"
    path.write_bytes("\ufeffZoë wrote\r\nthe memo.\n".encode("utf-8"))
    assert textdata.load_text(path) == "Zoë wrote\nthe memo.\n"  # BOM dropped, CRLF -> LF
    assert textdata.load_text(str(path)) == textdata.load_text(path)


def test_a_folder_is_its_txt_files_sorted_and_recursive(tmp_path):
    (tmp_path / "b.txt").write_text("second\n")
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "z.txt").write_text("first")
    (tmp_path / "c.md").write_text("not text data")
    (tmp_path / "d.txt").mkdir()  # a folder named *.txt is not a file
    assert textdata.load_text(tmp_path) == "first\n\nsecond"


@pytest.mark.parametrize("case", ["missing", "empty file", "blank file", "empty folder", "no txt", "binary", "latin-1",
                                  "folder with a binary txt"])
def test_bad_text_paths_are_one_line_errors(tmp_path, case):
    path = tmp_path / "data.txt"
    if case == "empty file":
        path.write_text("")
    elif case == "blank file":
        path.write_text(" \n\t\n")
    elif case == "empty folder":
        path = tmp_path / "empty"
        path.mkdir()
    elif case == "no txt":
        path = tmp_path
        (tmp_path / "notes.md").write_text("text")
    elif case == "binary":
        path.write_bytes(b"text\x00\x01\x02 more")
    elif case == "latin-1":
        path.write_bytes("Zoë".encode("latin-1"))
    elif case == "folder with a binary txt":
        (tmp_path / "ok.txt").write_text("fine")
        path.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
        path = tmp_path
    message = one_line_error("data.path", textdata.load_text, path)
    assert str(tmp_path) in message


# --------------------------------------------------------------------------------------- causal-LM rows
def test_sequences_of_the_builtin_text(gpt2):
    rows = textdata.sequences(textdata.builtin_text(), gpt2, 32)
    assert rows.dtype == torch.long and rows.dim() == 2 and rows.shape[1] == 32 and len(rows) > 3000
    assert len({tuple(r) for r in rows.tolist()}) == len(rows)  # no private sample twice
    ids = gpt2.encode(textdata.builtin_text()[:20_000])  # tokens well before the cut are the whole text's
    assert rows[:50].tolist() == windows(ids[:32 * 50], 32)  # the text's stream, cut in consecutive windows
    assert torch.equal(textdata.sequences(textdata.builtin_text(), gpt2, 32, limit=7), rows[:7])


def test_repeated_text_gives_each_window_once(gpt2):
    line = "the quick brown fox jumps over the lazy dog\n"  # 10 tokens with its newline
    assert len(gpt2.encode(line)) == 10
    rows = textdata.sequences(line * 6, gpt2, 5)
    assert rows.tolist() == [gpt2.encode(line)[:5], gpt2.encode(line)[5:]]


PIECES = ["ab", " ", "Z", ".", "\n", "\t", "\r", "é", "日", "the", " cat", "\n\n", "  ", "<|endoftext|>", "'s", "\n "]


@settings(max_examples=60, deadline=None)
@given(text=st.lists(st.sampled_from(PIECES), max_size=40).map("".join),
       seq_len=st.integers(2, 5), chunk=st.integers(1, 12))
def test_sequences_are_the_texts_disjoint_windows_whatever_the_chunking(gpt2, text, seq_len, chunk):
    ids = gpt2.encode(text)
    expected = windows(ids, seq_len)
    if not expected:
        one_line_error("data", textdata.sequences, text, gpt2, seq_len, chunk_chars=chunk)
        return
    rows = textdata.sequences(text, gpt2, seq_len, chunk_chars=chunk)
    assert rows.tolist() == expected and rows.shape == (len(expected), seq_len)


def test_too_little_text_is_an_error(gpt2):
    message = one_line_error("data", textdata.sequences, "Hello world", gpt2, 8)
    assert message == "data: the text has 2 tokens, fewer than data.seq_len=8"


@pytest.mark.parametrize("seq_len", [1, 0, -3, "8", 8.0, True, None])
def test_seq_len_is_validated(gpt2, seq_len):
    assert "data.seq_len" in one_line_error("data.seq_len", textdata.sequences, "Hello world again", gpt2, seq_len)


@pytest.mark.parametrize("limit", [0, -1, 2.5, "3", True])
def test_limit_is_validated(gpt2, limit):
    one_line_error("data.limit", textdata.sequences, "Hello world again", gpt2, 2, limit=limit)


# ----------------------------------------------------------------------------------- labelled sentences
COLA = (
    "gj04\t1\t\tOur friends won't buy this analysis, let alone the next one we propose.\n"
    "gj04\t0\t*\tThey drank the pub.\n"
    "\n"
    'clc95\t1\t\tThe "story" has\ta tab.\n'
)


def test_cola_tsv(tmp_path):
    path = tmp_path / "in_domain_train.tsv"
    path.write_text(COLA)
    texts, labels = textdata.load_labelled(path)
    assert labels == [1, 0, 1]
    assert texts[1] == "They drank the pub." and texts[2] == 'The "story" has\ta tab.'


@pytest.mark.parametrize("header", ["", "label\ttext\n"])
def test_two_column_tsv(tmp_path, header):
    path = tmp_path / "train.tsv"
    path.write_text(header + "2\tA private note.\n0\tAnother, with\ta tab.\n")
    assert textdata.load_labelled(path) == (["A private note.", "Another, with\ta tab."], [2, 0])


@pytest.mark.parametrize("content", ["", "label\ttext\n", "1\tgood\nno label here\n", "1\tok\nx\ty\n",
                                     "-1\tnegative\n", "gj04\t1\t\tok\ngj04\tbad\t\tline\n", "\x00\x01"])
def test_bad_labelled_files_are_one_line_errors(tmp_path, content):
    path = tmp_path / "bad.tsv"
    path.write_text(content)
    assert str(path) in one_line_error("data.path", textdata.load_labelled, path)


def test_a_missing_labelled_file_is_an_error(tmp_path):
    one_line_error("data.path", textdata.load_labelled, tmp_path / "missing.tsv")
    one_line_error("data.path", textdata.load_labelled, tmp_path)


def test_builtin_labelled_sentences():
    texts, labels = textdata.builtin_labelled(3)
    assert len(texts) > 1000 and len(set(texts)) == len(texts) and all(t.strip() == t and t for t in texts)
    assert labels == [i % 3 for i in range(len(texts))]
    assert texts[0].endswith(".") and "\n" not in texts[0]
    assert textdata.builtin_labelled(3) == (texts, labels)


@pytest.mark.parametrize("k", [1, 0, "2", True])
def test_builtin_labelled_needs_two_classes(k):
    one_line_error("model.num_classes", textdata.builtin_labelled, k)


def test_classification_rows_are_truncated_or_padded_with_eos(gpt2):
    texts = ["Hello world", "Hello world and more words than fit", "Hello world", "Hi"]
    tokens, labels = textdata.classification_sequences(texts, [0, 1, 1, 0], gpt2, 4)
    assert tokens.dtype == labels.dtype == torch.long
    assert tokens.tolist() == [[15496, 995, 50256, 50256], gpt2.encode(texts[1])[:4], [17250, 50256, 50256, 50256]]
    assert labels.tolist() == [0, 1, 0]  # the repeated sentence appears once (its first label)
    tokens, _ = textdata.classification_sequences(["Hi"], [0], gpt2, 3, pad_id=0)
    assert tokens.tolist() == [[17250, 0, 0]]


def test_classification_errors(gpt2, tmp_path):
    one_line_error("data", textdata.classification_sequences, ["a", "b"], [0], gpt2, 4)
    one_line_error("data", textdata.classification_sequences, [], [], gpt2, 4)
    one_line_error("data.seq_len", textdata.classification_sequences, ["a"], [0], gpt2, 0)
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    no_eos = tmp_path / "tokenizer.json"
    Tokenizer(WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]")).save(str(no_eos))
    one_line_error("data.tokenizer", textdata.classification_sequences, ["a"], [0], load_tokenizer(str(no_eos)), 4)


# ---------------------------------------------------------------------------------- `datasets` (cached)
def test_named_data_needs_the_datasets_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    for name in ("wikitext", "cola"):
        message = one_line_error("data.source", textdata.load_named, name)
        assert "pip install datasets" in message and "data.path" in message


def test_named_data_is_looked_up_offline_only(monkeypatch):
    seen = {}

    def load_dataset(path, config, split):
        seen["offline"] = os.environ.get("HF_DATASETS_OFFLINE"), os.environ.get("HF_HUB_OFFLINE")
        if path == "glue":
            raise ConnectionError("Couldn't reach the Hub\n(offline mode is enabled)")
        return {"text": ["", " = Title = \n", "Body text .\n"]}

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    assert textdata.load_named("wikitext", "validation") == " = Title = \nBody text .\n"
    assert seen["offline"] == ("1", "1") and "HF_DATASETS_OFFLINE" not in os.environ
    message = one_line_error("data.source", textdata.load_named, "cola")
    assert "not in the local datasets cache" in message and "load_dataset('glue', 'cola')" in message


def test_named_data_names_and_splits_are_checked():
    assert "'wikitext', 'cola'" in one_line_error("data.source", textdata.load_named, "imdb")
    one_line_error("data.split", textdata.load_named, "cola", "dev")


def test_aux_overlap_is_named_in_sequences_for_token_ids():
    """Auxiliary text sharing a window with the client's: refused, in the modality's words."""
    from guardfl.redteam.auxdata import AuxData
    from guardfl.redteam.modality.text.models import next_token_labels

    private = torch.arange(16).reshape(2, 8)
    aux_ids = torch.cat([private[:1], private[1:] + 100])
    aux = AuxData(aux_ids, next_token_labels(aux_ids), name="aux")
    with pytest.raises(ConfigError, match=r"^aux: 1 auxiliary sequence\(s\) are private sequences of the client"):
        aux.check_disjoint(private)
