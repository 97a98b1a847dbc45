"""Text: corpora, language models, tokenizers and metrics, and the text modality's entry in the registry."""

from __future__ import annotations

from guardfl.protect import soft_cross_entropy
from guardfl.redteam.modality.registry import Modality, register
from guardfl.redteam.modality.text import data, models
from guardfl.redteam.modality.text import tokenizer as tokenizer_mod

#: the per-sample thresholds of a text client (``modality.text.metrics``)
TEXT_THRESHOLDS = {"rouge1": ("max_rouge1", "max"), "rouge2": ("max_rouge2", "max"), "token_acc": ("max_token_acc", "max")}


def _vocab_size(tokenizer: str) -> int:
    """The vocabulary of the tokenizer named ``data.tokenizer`` (a built-in model's embedding rows)."""
    return tokenizer_mod.load_tokenizer(tokenizer).vocab_size


def _model_inputs(x):
    """A text model's attacker variables are token embeddings (TAG's), fed past the embedding lookup."""
    return (), {"inputs_embeds": x}


TEXT = register(Modality(
    name="text", unit="sequence", units="sequences", noun="text", model_kind="a text model",
    thresholds=TEXT_THRESHOLDS, models=frozenset(models.TEXT_MODELS), tokenized=True, loader=data.load_section,
    model_inputs=_model_inputs, loss=soft_cross_entropy, vocab_size=_vocab_size, check_path=data.check_text_size,
    ood=False, targets=False, inspection=False, encodings=False,
))
