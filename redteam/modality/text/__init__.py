"""Text: corpora, language models, tokenizers and metrics, and the text modality's entry in the registry."""

from __future__ import annotations

from guardfl.errors import ConfigError
from guardfl.protect import soft_cross_entropy
from guardfl.redteam.modality.registry import Modality, Recovery, register
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


def _client_model(name: str, num_classes: int, *, tokenizer: str, seq_len: int, **_image: object):
    """The text client's model, built before its data (its task picks the samples): for the tokenizer's
    vocabulary, checked against the protocol, the vocabulary and the sequence length (one-line errors
    naming the field)."""
    from guardfl.redteam.modality.image.models import build_model  # the one builder of every model name

    tok = tokenizer_mod.load_tokenizer(tokenizer)
    model = build_model(name, (seq_len,), num_classes, tok.vocab_size)
    if not models.is_text_model(model):
        raise ConfigError(f"model.name: {name} is not a text model (it needs .task 'causal-lm' or 'classification', "
                          "get_input_embeddings() and forward(tokens) / forward(inputs_embeds=...))")
    vocab = model.get_input_embeddings().num_embeddings
    if vocab != tok.vocab_size:
        raise ConfigError(f"data.tokenizer: {tokenizer!r} has {tok.vocab_size} tokens, the model's "
                          f"embedding {vocab}; use the model's own tokenizer")
    context = getattr(model, "context", None)
    if context is not None and seq_len > context:
        raise ConfigError(f"data.seq_len: {seq_len} tokens is longer than the model's context ({context}); "
                          f"allowed: 2..{context}")
    return model


def _evaluate(reconstruction, inputs, labels, **options) -> dict:
    """``metrics.evaluate_reconstruction``: ROUGE and token accuracy after matching, a classifier's labels."""
    from guardfl.redteam.modality.text import metrics  # rouge-score and scipy: imported when measuring

    return metrics.evaluate_reconstruction(reconstruction, inputs, labels, **options)


def _next_tokens(model) -> bool:
    """A causal LM's targets are its next tokens, i.e. the private text itself."""
    return getattr(model, "task", None) == "causal-lm"


TEXT = register(Modality(
    name="text", unit="sequence", units="sequences", noun="text", model_kind="a text model",
    thresholds=TEXT_THRESHOLDS, models=frozenset(models.TEXT_MODELS), tokenized=True, loader=data.load_section,
    model_inputs=_model_inputs, loss=soft_cross_entropy, vocab_size=_vocab_size, check_path=data.check_text_size,
    evaluate=_evaluate, recovery=Recovery("rouge1", "max_rouge1", "token_acc", 1.0),
    client_model=_client_model, targets_are_inputs=_next_tokens,
    ood=False, targets=False, inspection=False, encodings=False, class_labels=False,
))
