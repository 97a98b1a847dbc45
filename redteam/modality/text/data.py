"""Text the red team attacks with: where it comes from and how it becomes rows of token ids.

Sources (every error is one line naming the config field):

* :func:`builtin_text`: the no-download English default, CPython's own documentation topics
  (``pydoc_data/topics.py``, the text ``help("assert")`` shows: 79 topics, about 465,000 characters,
  about 139,000 GPT-2 tokens; prose with some grammar and code excerpts).
* :func:`load_text`: a UTF-8 file, or a folder's ``*.txt`` files (``data.path``).
* :func:`load_named`: ``"wikitext"`` (wikitext-2-raw-v1) or ``"cola"`` (GLUE CoLA) from the ``datasets``
  package's local cache only (``data.source``).
* :func:`load_labelled` / :func:`builtin_labelled`: sentences with class labels, for a text classifier.
* :func:`load_text_data` / :func:`load_section`: a source's samples for the client's model task.

:func:`sequences` turns a text into causal-LM samples: consecutive non-overlapping windows of exactly
``seq_len`` tokens of the text's token stream (the tail is dropped), each distinct window once, as the
LTI and breaching text evaluations cut wikitext into fixed-length blocks. :func:`classification_sequences`
truncates / pads each labelled sentence to ``seq_len``.
"""

from __future__ import annotations

import os
import re
import sys
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from guardfl.data import DataError
from guardfl.errors import ConfigError
from guardfl.redteam.modality.sources import SOURCES
from guardfl.redteam.modality.text.models import next_token_labels
from guardfl.redteam.modality.text.tokenizer import load_tokenizer

#: the text is encoded in pieces of about this many characters, cut where the pre-tokeniser always cuts
CHUNK_CHARS = 1 << 16
#: a line that ends in a non-space character, followed by a line that starts with one: GPT-2's
#: pre-tokeniser never joins "\n" and a non-space character into one piece, and the newline run there has
#: length 1, so encoding the pieces on either side apart gives the same ids as encoding the whole text
_SAFE_CUT = re.compile(r"(?<=\S\n)(?=\S)")
NAMED = {"wikitext": ("wikitext", "wikitext-2-raw-v1"), "cola": ("glue", "cola")}
SPLITS = ("train", "validation", "test")


def _one_line(err: object) -> str:
    return " ".join(str(err).split())


# ----------------------------------------------------------------------------------------------- sources
@lru_cache(maxsize=1)
def builtin_text() -> str:
    """The built-in English text: the values of CPython's ``pydoc_data.topics.topics`` (the documentation
    behind ``help()`` on keywords and topics), in the module's order, joined by blank lines. Shipped with
    every CPython, so it needs no download; it is the default private and auxiliary text."""
    try:
        import pydoc_data.topics
    except ImportError:  # some distributions strip pydoc_data
        raise ConfigError("data.path: this Python has no pydoc_data (the built-in text); give data.path "
                          "(a UTF-8 .txt file or a folder of them)") from None
    return "\n\n".join(v.strip("\n") for v in pydoc_data.topics.topics.values())


#: the most bytes of text ``data.path`` (or ``aux.path``) may hold, a file or a folder's ``*.txt`` files
#: together: checked from the sizes before anything is read (the text is decoded and tokenised whole; the
#: red team attacks a few thousand sequences, which a few MiB hold)
MAX_TEXT_BYTES = 256 << 20


def _text_files(p: Path) -> list[Path]:
    return sorted((f for f in p.rglob("*.txt") if f.is_file()), key=lambda f: f.relative_to(p).as_posix())


def check_text_size(path: str | os.PathLike | None, field: str = "data.path") -> None:
    """ConfigError (one line, ``field``, the size and the bound) when the text at ``path`` is larger than
    ``MAX_TEXT_BYTES``; nothing for None or a path that does not exist (reading it reports that)."""
    if path is None:
        return
    p = Path(os.path.expanduser(os.fspath(path)))
    try:
        if p.is_dir():
            size = sum(f.stat().st_size for f in _text_files(p))
        elif p.is_file():
            size = p.stat().st_size
        else:
            return
    except OSError:
        return
    if size > MAX_TEXT_BYTES:
        raise ConfigError(f"{field}: {p} holds {size / (1 << 20):.0f} MiB of text; allowed: at most "
                          f"{MAX_TEXT_BYTES >> 20} MiB (the red team reads it whole): give a smaller file or folder")


def _read_utf8(path: Path) -> str:
    raw = path.read_bytes()
    if b"\x00" in raw:
        raise ConfigError(f"data.path: {path} is not UTF-8 text (it holds NUL bytes: a binary file?)")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise ConfigError(f"data.path: {path} is not UTF-8 text (byte {err.start}: {err.reason})") from None
    return text.replace("\r\n", "\n")


def load_text(path: str | os.PathLike | None) -> str:
    """The text at ``path``: None -> :func:`builtin_text`; a file -> its UTF-8 text (a BOM is dropped,
    CRLF becomes LF); a folder -> its ``*.txt`` files, recursively, in sorted order of their relative
    paths, joined by a blank line. Errors: a missing path, no text (empty or whitespace only; a folder
    without ``*.txt`` files), a file that is not UTF-8 text (NUL bytes or invalid UTF-8)."""
    if path is None:
        return builtin_text()
    p = Path(os.path.expanduser(os.fspath(path)))
    check_text_size(p)
    if p.is_dir():
        files = _text_files(p)
        if not files:
            raise ConfigError(f"data.path: the folder {p} has no *.txt files")
        text = "\n\n".join(_read_utf8(f).strip("\n") for f in files)
    elif p.is_file():
        text = _read_utf8(p)
    else:
        raise ConfigError(f"data.path: {p} does not exist (give a UTF-8 .txt file or a folder of them)")
    if not text.strip():
        raise ConfigError(f"data.path: {p} has no text")
    return text


# --------------------------------------------------------------------------------------- causal-LM rows
def _check_seq_len(seq_len: Any, minimum: int) -> int:
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < minimum:
        raise ConfigError(f"data.seq_len: expected an integer >= {minimum} (got {seq_len!r})")
    return seq_len


def _chunks(text: str, size: int) -> Iterator[str]:
    """``text`` in consecutive pieces of at least ``size`` characters (the last may be shorter), cut only
    at :data:`_SAFE_CUT` points."""
    pos = 0
    while pos < len(text):
        cut = _SAFE_CUT.search(text, min(pos + size, len(text)))
        end = cut.start() if cut else len(text)
        yield text[pos:end]
        pos = end


def _encode_batch(tokenizer, texts: list[str]) -> list[list[int]]:
    if hasattr(tokenizer, "encode_batch"):
        return tokenizer.encode_batch(texts)
    return [tokenizer.encode(t) for t in texts]


def sequences(text: str, tokenizer, seq_len: int, *, limit: int | None = None, chunk_chars: int = CHUNK_CHARS) -> torch.Tensor:
    """Causal-LM samples of ``text``: a LongTensor ``(N, seq_len)``.

    The text's token stream is cut into consecutive non-overlapping windows of exactly ``seq_len`` tokens
    (the tail shorter than a window is dropped). A window identical to an earlier one is dropped: the red
    team must not hold the same private sample twice, and auxiliary windows must differ from private ones
    by content, not only by position. Order is the text's. ``limit``: stop after that many windows.

    The text is encoded in line-aligned pieces of about ``chunk_chars`` characters (in parallel, and only
    as far as ``limit`` needs), cut where a line ending in a non-space character meets one starting with a
    non-space character. GPT-2's pre-tokeniser always splits there, so for the built-in tokenizer the
    stream is exactly ``tokenizer.encode(text)``; a tokenizer whose pre-tokeniser joins across newlines
    (none of the usual BPE / WordPiece / SentencePiece ones) could differ at those cuts.
    """
    seq_len = _check_seq_len(seq_len, 2)
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ConfigError(f"data.limit: expected an integer >= 1 or None (got {limit!r})")
    windows: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()
    buffer: list[int] = []
    total = 0
    pieces = _chunks(text, max(1, int(chunk_chars)))
    batch_size = max(1, (os.cpu_count() or 1) * 2)
    done = False
    while not done:
        batch = [p for _, p in zip(range(batch_size), pieces)]
        if not batch:
            break
        for ids in _encode_batch(tokenizer, batch):
            buffer.extend(ids)
            total += len(ids)
        start = 0
        while len(buffer) - start >= seq_len:
            window = tuple(buffer[start:start + seq_len])
            start += seq_len
            if window not in seen:
                seen.add(window)
                windows.append(list(window))
                if limit is not None and len(windows) >= limit:
                    done = True
                    break
        del buffer[:start]
    if not windows:
        raise ConfigError(f"data: the text has {total} tokens, fewer than data.seq_len={seq_len}")
    return torch.tensor(windows, dtype=torch.long)


# ----------------------------------------------------------------------------------- labelled sentences
def _is_int(s: str) -> bool:
    return s.strip().lstrip("+-").isdigit()


def _layout(line: str) -> str | None:
    fields = line.split("\t")
    if len(fields) >= 4 and _is_int(fields[1]):
        return "cola"
    if len(fields) >= 2 and _is_int(fields[0]):
        return "pair"
    return None


def load_labelled(path: str | os.PathLike) -> tuple[list[str], list[int]]:
    """``(sentences, labels)`` from a UTF-8 tab-separated file in one of two layouts, told apart by its
    first data line:

    * CoLA's (GLUE ``in_domain_train.tsv`` / ``train.tsv`` / ``dev.tsv``): 4 columns, no header:
      ``source<TAB>label<TAB>original-marker<TAB>sentence``;
    * two columns ``label<TAB>text``, with or without a header line (a first line whose label is not an
      integer, such as ``label<TAB>text``, is skipped).

    Labels are integers >= 0. Blank lines are skipped; fields are not quoted (CoLA's sentences hold
    quotes), so no CSV quoting rules apply. Every bad line is a one-line error naming ``data.path``.
    """
    p = Path(os.path.expanduser(os.fspath(path)))
    if not p.is_file():
        raise ConfigError(f"data.path: {p} is not a file (expected a CoLA TSV or a label<TAB>text TSV)")
    check_text_size(p)
    lines = [(n, line) for n, line in enumerate(_read_utf8(p).split("\n"), 1) if line.strip()]
    if lines and _layout(lines[0][1]) is None:
        lines = lines[1:]  # a header
    if not lines:
        raise ConfigError(f"data.path: {p} has no labelled sentences")
    cola = _layout(lines[0][1]) == "cola"
    texts: list[str] = []
    labels: list[int] = []
    for n, line in lines:
        fields = line.split("\t", 3) if cola else line.split("\t", 1)
        if len(fields) != (4 if cola else 2) or not _is_int(fields[1 if cola else 0]):
            layout = "CoLA's source<TAB>label<TAB>marker<TAB>sentence" if cola else "label<TAB>text"
            raise ConfigError(f"data.path: {p} line {n} is not {layout} (the layout of its first line)")
        label, text = int(fields[1 if cola else 0]), fields[3 if cola else 1].strip()
        if label < 0:
            raise ConfigError(f"data.path: {p} line {n}: label {label} is negative")
        if text:
            texts.append(text)
            labels.append(label)
    if not texts:
        raise ConfigError(f"data.path: {p} has no labelled sentences")
    return texts, labels


def builtin_labelled(num_classes: int) -> tuple[list[str], list[int]]:
    """No-download labelled sentences: the built-in text (:func:`builtin_text`) split on ``". "``,
    whitespace collapsed, empty and repeated sentences dropped, with synthetic labels ``i % num_classes``
    (as the image red team's built-in LFW faces get arbitrary labels: the label is something the model is
    trained on, not a property of the sentence)."""
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2:
        raise ConfigError(f"model.num_classes: expected an integer >= 2 (got {num_classes!r})")
    pieces = builtin_text().split(". ")
    texts: list[str] = []
    seen: set[str] = set()
    for i, piece in enumerate(pieces):
        sentence = " ".join(piece.split())
        if sentence and i < len(pieces) - 1:
            sentence += "."
        if sentence and sentence not in seen:
            seen.add(sentence)
            texts.append(sentence)
    return texts, [i % num_classes for i in range(len(texts))]


def classification_sequences(texts: Sequence[str], labels: Sequence[int], tokenizer, seq_len: int,
                             pad_id: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens (N, seq_len), labels (N,))``, LongTensors: each sentence's ids truncated to ``seq_len`` or
    right-padded with ``pad_id`` (default the tokenizer's end-of-text id, as GPT-2 classifiers pad). Rows
    identical after truncation appear once (the first; same reason as :func:`sequences`), so N can be
    below ``len(texts)``. ``seq_len`` >= 1 (a classifier needs no next token)."""
    seq_len = _check_seq_len(seq_len, 1)
    if len(texts) != len(labels):
        raise ConfigError(f"data: {len(texts)} sentences but {len(labels)} labels")
    if not texts:
        raise ConfigError("data: no labelled sentences")
    if pad_id is None:
        pad_id = getattr(tokenizer, "eos_id", None)
        if pad_id is None:
            raise ConfigError(f"data.tokenizer: {getattr(tokenizer, 'name', tokenizer)!r} has no end-of-text token to pad with")
    rows: list[list[int]] = []
    kept: list[int] = []
    seen: set[tuple[int, ...]] = set()
    for ids, label in zip(_encode_batch(tokenizer, list(texts)), labels):
        row = tuple(ids[:seq_len]) + (int(pad_id),) * max(0, seq_len - len(ids))
        if row not in seen:
            seen.add(row)
            rows.append(list(row))
            kept.append(int(label))
    return torch.tensor(rows, dtype=torch.long), torch.tensor(kept, dtype=torch.long)


# ---------------------------------------------------------------------------------- `datasets` (cached)
@contextmanager
def _offline() -> Iterator[None]:
    """``HF_DATASETS_OFFLINE=1`` / ``HF_HUB_OFFLINE=1`` for the duration, in the environment and in the
    constants ``datasets`` and ``huggingface_hub`` read them into at import."""
    saved_env = {k: os.environ.get(k) for k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")}
    patched: list[tuple[Any, str, Any]] = []
    for module_name, attrs in (("datasets.config", ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")),
                               ("huggingface_hub.constants", ("HF_HUB_OFFLINE",))):
        module = sys.modules.get(module_name)
        for attr in attrs:
            if module is not None and hasattr(module, attr):
                patched.append((module, attr, getattr(module, attr)))
                setattr(module, attr, True)
    os.environ.update({k: "1" for k in saved_env})
    try:
        yield
    finally:
        for module, attr, value in patched:
            setattr(module, attr, value)
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def load_named(name: str, split: str = "train") -> str | tuple[list[str], list[int]]:
    """A named data set from the ``datasets`` package's local cache, never downloaded:
    ``"wikitext"`` (wikitext-2-raw-v1) -> its text (the ``text`` column joined, as the LTI and breaching
    text evaluations use it); ``"cola"`` (GLUE CoLA) -> ``(sentences, labels)`` (CoLA's test split has no
    labels: -1). Without ``datasets`` or without the data set in its cache: a one-line error naming
    ``data.source`` that says how to get it."""
    if name not in NAMED:
        raise ConfigError(f"data.source: {name!r}; allowed: {', '.join(map(repr, NAMED))} (or give data.path)")
    if split not in SPLITS:
        raise ConfigError(f"data.split: {split!r}; allowed: {', '.join(map(repr, SPLITS))}")
    path, config = NAMED[name]
    fetch = f"python -c \"import datasets; datasets.load_dataset('{path}', '{config}')\""
    try:
        import datasets
    except ImportError:
        raise ConfigError(f"data.source: {name!r} needs the datasets package and the data set in its local cache "
                          f"(online, once: pip install datasets && {fetch}); or give data.path (a .txt file or folder)") from None
    with _offline():
        try:
            ds = datasets.load_dataset(path, config, split=split)
        except Exception as err:
            raise ConfigError(f"data.source: {name!r} ({path}/{config}, split {split!r}) is not in the local datasets "
                              f"cache ({_one_line(err)[:200]}); online, once: {fetch}") from None
    if name == "wikitext":
        return "".join(ds["text"])
    return [str(s) for s in ds["sentence"]], [int(v) for v in ds["label"]]


# ------------------------------------------------------------------------------ a source, for a model task
def _task_of(source: str) -> str | None:
    """The model task a source's samples feed (the source table): ``causal-lm``, ``classification``, None."""
    entry = SOURCES.get(source)
    return entry.task if entry is not None else None


def load_text_data(source: str, *, path: str | None, seq_len: int, tokenizer: str, task: str, num_classes: int,
                   split: str = "test", limit: int | None = None, field: str = "data") -> tuple[torch.Tensor, torch.Tensor]:
    """Text samples for a text model: token ids ``(N, seq_len)`` and the client's targets for them.

    ``task`` is the model's: ``causal-lm`` trains on windows of ``seq_len`` tokens of a plain text
    (``text``: ``path`` a file or a folder of .txt files, None the built-in text; ``wikitext``), its
    targets the next tokens ``(N, seq_len)`` (-100 on the last position); ``classification`` on labelled
    sentences (``labelled-text``: a TSV at ``path``, None the built-in sentences with synthetic labels;
    ``cola``), truncated or padded to ``seq_len``, its targets the classes ``(N,)``."""
    tok = load_tokenizer(tokenizer)
    if task == "causal-lm":
        if _task_of(source) != "causal-lm":
            raise DataError(f"{field}.source: {source!r} is labelled sentences; a causal language model trains on "
                            "plain text: 'text' (a file, a folder, or the built-in text) or 'wikitext'")
        text = load_named("wikitext", split) if source == "wikitext" else load_text(path)
        x = sequences(text, tok, seq_len, limit=limit)
        return x, next_token_labels(x)
    if _task_of(source) != "classification":
        raise DataError(f"{field}.source: {source!r} is plain text; a classifier trains on labelled sentences: "
                        "'labelled-text' (a TSV, or the built-in sentences) or 'cola'")
    if source == "cola":
        texts, labels = load_named("cola", split)
    elif path is None:
        texts, labels = builtin_labelled(num_classes)
    else:
        texts, labels = load_labelled(path)
    if labels and (min(labels) < 0 or max(labels) >= num_classes):
        raise DataError(f"{field}: labels {min(labels)}..{max(labels)} do not fit model.num_classes={num_classes} "
                        "(CoLA's test split is unlabelled: use split 'validation' or 'train')")
    x, y = classification_sequences(texts, labels, tok, seq_len)
    return (x[:limit], y[:limit]) if limit else (x, y)


def load_section(section, *, num_classes: int, seq_len: int, tokenizer: str, task: Any = None, limit: int | None = None,
                 field: str = "data", **_image: object) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`load_text_data` of a source section (``source``, ``path``, ``split``). ``task``: the model's
    (a callable giving it is called first); None: the task the source's samples feed (the source table)."""
    task = task() if callable(task) else task or _task_of(section.source)
    return load_text_data(section.source, path=section.path, seq_len=seq_len, tokenizer=tokenizer, task=task,
                          num_classes=num_classes, split=section.split, limit=limit, field=field)
