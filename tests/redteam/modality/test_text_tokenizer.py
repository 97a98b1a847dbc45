"""The text red team's tokenizers: GPT-2's BPE built in, tokenizer.json files and the local Hugging Face
cache, never a download."""

from __future__ import annotations

import json

import pytest
import tokenizers
import torch
from hypothesis import given, settings, strategies as st

from guardfl.errors import ConfigError
from guardfl.redteam.modality.text import tokenizer as tok_mod
from guardfl.redteam.modality.text.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def gpt2():
    return load_tokenizer("gpt2")


@pytest.fixture(autouse=True)
def _no_download(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a download was attempted")

    monkeypatch.setattr(tokenizers.Tokenizer, "from_pretrained", refuse)


def tiny_backend(truncate: int | None = None) -> tokenizers.Tokenizer:
    """A word-level tokenizer with no end-of-text token."""
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {"[UNK]": 0, "the": 1, "cat": 2, "sat": 3, "on": 4, "mat": 5}
    backend = tokenizers.Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = Whitespace()
    if truncate:
        backend.enable_truncation(truncate)
    return backend


def assert_one_line_error(err: pytest.ExceptionInfo, field: str) -> str:
    text = str(err.value)
    assert text.startswith(f"{field}: ") and "\n" not in text
    return text


def test_gpt2_is_gpt2(gpt2):
    assert gpt2.name == "gpt2" and gpt2.vocab_size == 50257 and gpt2.eos_id == 50256
    assert gpt2.encode("Hello world") == [15496, 995]
    assert gpt2.encode(" Hello world\n\nfoo") == [18435, 995, 198, 198, 21943]
    assert gpt2.encode("a<|endoftext|>b") == [64, 50256, 65]  # as Hugging Face's GPT2TokenizerFast
    assert gpt2.decode([15496, 995, 50256]) == "Hello world<|endoftext|>"  # special tokens kept


def test_gpt2_is_cached_per_name(gpt2):
    assert load_tokenizer() is gpt2 and load_tokenizer("gpt2") is gpt2


@settings(max_examples=80, deadline=None)
@given(text=st.text(max_size=60))
def test_byte_level_round_trip(gpt2, text):
    ids = gpt2.encode(text)
    assert gpt2.decode(ids) == text
    assert gpt2.decode(torch.tensor(ids, dtype=torch.long)) == text  # tensors too
    assert all(0 <= i < gpt2.vocab_size for i in ids)


@settings(max_examples=40, deadline=None)
@given(text=st.text(alphabet=st.characters(min_codepoint=9, max_codepoint=126), max_size=60))
def test_tokens_are_each_ids_text(gpt2, text):
    ids = gpt2.encode(text)
    pieces = gpt2.tokens(ids)
    assert len(pieces) == len(ids) and "".join(pieces) == text


def test_tokens_of_a_split_character_show_the_replacement_character(gpt2):
    ids = gpt2.encode("日本")
    assert gpt2.decode(ids) == "日本" and "\ufffd" in "".join(gpt2.tokens(ids))


def test_fingerprint_is_the_content_not_the_source(gpt2, tmp_path):
    fp = gpt2.fingerprint()
    assert len(fp) == 64 and int(fp, 16) >= 0 and gpt2.fingerprint() == fp
    path = tmp_path / "tokenizer.json"
    gpt2.backend.save(str(path))
    copy = load_tokenizer(str(path))
    assert copy is not gpt2 and copy.fingerprint() == fp
    assert copy.encode("Hello world") == [15496, 995] and copy.eos_id == 50256
    other = tmp_path / "other.json"
    tiny_backend().save(str(other))
    assert load_tokenizer(str(other)).fingerprint() != fp


def test_a_tokenizer_json_path_or_its_folder(tmp_path):
    path = tmp_path / "tokenizer.json"
    tiny_backend(truncate=2).save(str(path))
    tok = load_tokenizer(str(path))
    assert tok.encode("the cat sat on the mat") == [1, 2, 3, 4, 1, 5]  # its truncation setting is switched off
    assert tok.vocab_size == 6 and tok.eos_id is None
    assert tok.decode([1, 2]) == "the cat" and tok.tokens([1, 2]) == ["the", "cat"]
    assert load_tokenizer(str(tmp_path)).encode("the mat") == [1, 5]


def test_an_edited_file_is_reloaded(tmp_path):
    path = tmp_path / "tokenizer.json"
    tiny_backend().save(str(path))
    first = load_tokenizer(str(path))
    assert load_tokenizer(str(path)) is first
    spec = json.loads(path.read_text())
    spec["model"]["vocab"]["dog"] = 6
    path.write_text(json.dumps(spec) + "\n")  # another size: another cache key
    assert load_tokenizer(str(path)).encode("dog") == [6]


def fake_hub(root, repo: str, snapshot: str = "abc123", main: bool = True):
    folder = root / ("models--" + repo.replace("/", "--"))
    (folder / "snapshots" / snapshot).mkdir(parents=True)
    tiny_backend().save(str(folder / "snapshots" / snapshot / "tokenizer.json"))
    if main:
        (folder / "refs").mkdir()
        (folder / "refs" / "main").write_text(snapshot)
    return folder


@pytest.mark.parametrize("env", ["HF_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"])
def test_a_hugging_face_name_from_the_local_cache(tmp_path, monkeypatch, env):
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    hub = {"HF_HUB_CACHE": tmp_path, "HF_HOME": tmp_path / "hub", "XDG_CACHE_HOME": tmp_path / "huggingface" / "hub"}[env]
    hub.mkdir(parents=True, exist_ok=True)
    monkeypatch.setenv(env, str(tmp_path))
    assert tok_mod.hub_cache() == hub
    fake_hub(hub, "someorg/tiny-model")
    fake_hub(hub, "bare-name", main=False)
    assert load_tokenizer("someorg/tiny-model").encode("the cat") == [1, 2]
    assert load_tokenizer("bare-name").name == "bare-name"


def bad_name_error(name) -> str:
    with pytest.raises(ConfigError) as err:
        load_tokenizer(name)
    return assert_one_line_error(err, "data.tokenizer")


@pytest.mark.parametrize("name", ["", "  ", None, 3, "not-cached/model", "no-such-model", "./missing/tokenizer.json",
                                  "a/b/c", "../x", "line\nbreak"])
def test_unknown_names_are_one_line_errors(tmp_path, monkeypatch, name):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    text = bad_name_error(name)
    assert tok_mod.ALLOWED in text


def test_a_cached_repo_without_tokenizer_json_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    (tmp_path / "models--org--old" / "snapshots" / "abc").mkdir(parents=True)
    (tmp_path / "models--org--old" / "snapshots" / "abc" / "vocab.json").write_text("{}")
    assert "nothing is downloaded" in bad_name_error("org/old")


@pytest.mark.parametrize("content", [b"not json at all\n{", b'{"model": 3}\n', b"\x00\x01\x02"])
def test_a_broken_tokenizer_json_is_an_error(tmp_path, content):
    path = tmp_path / "tokenizer.json"
    path.write_bytes(content)
    assert str(path) in bad_name_error(str(path))


def test_a_folder_without_tokenizer_json_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    bad_name_error(str(tmp_path))
