"""Text models the text tests share beyond ``guardfl.redteam.textmodels``' own.

Shared by tests/guardfl/test_text_models.py and tests/integrations/test_text_integrations.py.
"""

from __future__ import annotations

from torch import nn


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
