"""Text models the text tests share beyond ``guardfl.redteam.modality.text.models``' own.

Shared by tests/guardfl/test_text_models.py and tests/integrations/test_text_integrations.py.
"""

from __future__ import annotations

import torch
from torch import nn

from guardfl.redteam.modality.text.models import TextClassifier, Transformer3

#: small text models for fast tests: vocabulary, context, sequence length, classes
VOCAB, CONTEXT, LENGTH, CLASSES = 1000, 32, 12, 3
#: the kinds ``make`` builds
MODELS = ["causal-lm", "causal-lm-tied", "classifier"]


def make(kind: str) -> nn.Module:
    """A seeded small model of ``kind``: the causal LM, its tied (frozen-embedding) variant, or the classifier."""
    torch.manual_seed(0)
    if kind == "classifier":
        return TextClassifier(vocab_size=VOCAB, num_classes=CLASSES, context=CONTEXT)
    return Transformer3(vocab_size=VOCAB, context=CONTEXT, tied=kind.endswith("tied"))


class AttentionClassifier(nn.Module):
    """A text classifier on torch's own ``nn.TransformerEncoderLayer`` (``nn.MultiheadAttention``, which
    Opacus has no per-sample sampler for: ``protect`` swaps it for ``DPMultiheadAttention``)."""

    def __init__(self, vocab: int = 1000, classes: int = 3) -> None:
        super().__init__()
        self.token = nn.Embedding(vocab, 16)
        self.encoder = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(16, classes)

    def forward(self, tokens):
        return self.head(self.encoder(self.token(tokens)).mean(1))
