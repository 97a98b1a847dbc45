"""Built-in text models: the small causal transformer of the LTI and breaching text evaluations
(``transformer3``) and a tiny sequence classifier.

Both are built from layers Opacus computes per-sample gradients for (``nn.Embedding``, ``nn.Linear`` on
(N, L, D) inputs, ``nn.LayerNorm``); attention is written out (no ``nn.MultiheadAttention``, which Opacus
only takes after swapping it for its own ``DPMultiheadAttention``; no fused scaled-dot-product kernel,
whose backward is not twice differentiable on every device: gradient-matching attacks differentiate the
gradient). Positions are learned embeddings looked up with a batch dimension (``(N, L)`` position ids),
so Opacus's embedding sampler sees one row per sample. Dropout is 0: the update of a client in train
mode is then a function of its batch alone, as for the vision models.

The text-model protocol every text attack relies on (Hugging Face's names, so a ``transformers`` model
fits too): ``model(tokens)`` gives logits (``(N, L, V)`` next-token logits for a causal LM, ``(N, K)``
class logits for a classifier); ``model(inputs_embeds=E)`` runs the same network on token embeddings
``E`` of shape ``(N, L, D)`` (TAG optimises them); ``model.get_input_embeddings()`` is the token
``nn.Embedding``; ``model.task`` is ``"causal-lm"`` or ``"classification"``; ``model.context`` the
longest sequence it takes.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

#: the GPT-2 byte-level BPE vocabulary size (50,000 merges + 256 bytes + <|endoftext|>)
GPT2_VOCAB = 50257


class SelfAttention(nn.Module):
    """Multi-head self-attention, causal or not: one ``Linear`` for queries, keys and values, one for the
    output; softmax(QK^T / sqrt(d_head) + mask) V written out."""

    def __init__(self, width: int, heads: int, causal: bool) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} must be a multiple of heads {heads}")
        self.heads, self.causal = heads, causal
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)

    def forward(self, h: Tensor) -> Tensor:
        n, length, width = h.shape
        q, k, v = self.qkv(h).view(n, length, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / math.sqrt(width // self.heads)
        if self.causal:
            mask = torch.ones(length, length, dtype=torch.bool, device=h.device).triu(1)
            scores = scores.masked_fill(mask, float("-inf"))
        mixed = (scores.softmax(-1) @ v).transpose(1, 2).reshape(n, length, width)
        return self.out(mixed)


class Block(nn.Module):
    """A post-norm transformer layer as ``torch.nn.TransformerEncoderLayer`` builds it (ReLU FFN, no
    dropout): ``h = LN(h + attn(h)); h = LN(h + FFN(h))``."""

    def __init__(self, width: int, heads: int, ffn: int, causal: bool) -> None:
        super().__init__()
        self.attn = SelfAttention(width, heads, causal)
        self.norm1 = nn.LayerNorm(width)
        self.ff1 = nn.Linear(width, ffn)
        self.ff2 = nn.Linear(ffn, width)
        self.norm2 = nn.LayerNorm(width)

    def forward(self, h: Tensor) -> Tensor:
        h = self.norm1(h + self.attn(h))
        return self.norm2(h + self.ff2(F.relu(self.ff1(h))))


class _TextModel(nn.Module):
    task: str = ""

    def __init__(self, vocab_size: int, width: int, heads: int, ffn: int, layers: int, context: int, causal: bool) -> None:
        super().__init__()
        self.vocab_size, self.width, self.context = vocab_size, width, context
        self.token = nn.Embedding(vocab_size, width)
        self.position = nn.Embedding(context, width)
        self.blocks = nn.Sequential(*[Block(width, heads, ffn, causal) for _ in range(layers)])

    def get_input_embeddings(self) -> nn.Embedding:
        return self.token

    def get_position_embeddings(self) -> nn.Embedding:
        return self.position

    def _encode(self, tokens: Tensor | None, inputs_embeds: Tensor | None) -> Tensor:
        if (tokens is None) == (inputs_embeds is None):
            raise ValueError("give exactly one of tokens and inputs_embeds")
        e = self.token(tokens) if inputs_embeds is None else inputs_embeds
        n, length = e.shape[:2]
        if length > self.context:
            raise ValueError(f"sequence of {length} tokens; this model's context is {self.context}")
        positions = torch.arange(length, device=e.device).expand(n, length)
        return self.blocks(e + self.position(positions))


class Transformer3(_TextModel):
    """The 3-layer causal transformer of the breaching / LTI text evaluations: width 96, 8 heads, FFN 1,536,
    learned positions, the GPT-2 BPE vocabulary. ``tied=False`` (default): its own output layer, every
    weight trained (the token embedding's gradient then has non-zero rows exactly for the tokens of the
    batch that feed a prediction, i.e. all but a token seen only at a sequence's last position: a leak TAG
    uses). ``tied=True``: the output layer is the token embedding, and both are frozen,
    Wu et al. 2023's setting (Sec. 4.2: "three-layer transformer with frozen token embedding layer",
    about 1.1M trainable parameters)."""

    task = "causal-lm"

    def __init__(self, vocab_size: int = GPT2_VOCAB, width: int = 96, heads: int = 8, ffn: int = 1536, layers: int = 3,
                 context: int = 256, tied: bool = False) -> None:
        super().__init__(vocab_size, width, heads, ffn, layers, context, causal=True)
        self.tied = tied
        if tied:
            self.token.weight.requires_grad_(False)
            self.decoder = None
        else:
            self.decoder = nn.Linear(width, vocab_size)

    def forward(self, tokens: Tensor | None = None, *, inputs_embeds: Tensor | None = None) -> Tensor:
        h = self._encode(tokens, inputs_embeds)
        return F.linear(h, self.token.weight) if self.decoder is None else self.decoder(h)


class TextClassifier(_TextModel):
    """A tiny bidirectional transformer classifier (BERT-like at toy scale): 2 layers, width 64, 4 heads,
    FFN 256, mean-pooled over positions, one linear layer to the classes. Every weight is trained."""

    task = "classification"

    def __init__(self, vocab_size: int = GPT2_VOCAB, num_classes: int = 2, width: int = 64, heads: int = 4, ffn: int = 256,
                 layers: int = 2, context: int = 256) -> None:
        super().__init__(vocab_size, width, heads, ffn, layers, context, causal=False)
        self.classifier = nn.Linear(width, num_classes)

    def forward(self, tokens: Tensor | None = None, *, inputs_embeds: Tensor | None = None) -> Tensor:
        return self.classifier(self._encode(tokens, inputs_embeds).mean(1))


def transformer3(vocab_size: int = GPT2_VOCAB, num_classes: int | None = None, context: int = 256) -> Transformer3:
    return Transformer3(vocab_size, context=context)


def transformer3_tied(vocab_size: int = GPT2_VOCAB, num_classes: int | None = None, context: int = 256) -> Transformer3:
    return Transformer3(vocab_size, context=context, tied=True)


def text_classifier(vocab_size: int = GPT2_VOCAB, num_classes: int = 2, context: int = 256) -> TextClassifier:
    return TextClassifier(vocab_size, num_classes, context=context)


#: text models by ``model.name``: factory(vocab_size, num_classes, context)
TEXT_MODELS = {
    "transformer3": transformer3,
    "transformer3-tied": transformer3_tied,
    "text-classifier": text_classifier,
}


def is_text_model(model: nn.Module) -> bool:
    """Whether ``model`` follows the text-model protocol (a task and an input embedding)."""
    return getattr(model, "task", None) in ("causal-lm", "classification") and callable(getattr(model, "get_input_embeddings", None))


def embedding_names(model: nn.Module) -> tuple[str | None, str | None]:
    """The parameter names of the model's token embedding (``get_input_embeddings``) and of its learned
    position embedding: ``get_position_embeddings()`` when the model has it (Hugging Face's name), else
    the one other ``nn.Embedding`` of the token embedding's width. None for what it lacks (a Hugging Face
    model whose ``get_position_embeddings`` raises ``NotImplementedError`` has none to read)."""
    token = model.get_input_embeddings() if callable(getattr(model, "get_input_embeddings", None)) else None
    position = None
    getter = getattr(model, "get_position_embeddings", None)
    if callable(getter):
        try:
            position = getter()
        except NotImplementedError:
            position = None
    elif token is not None:
        others = [m for m in model.modules() if isinstance(m, nn.Embedding) and m is not token
                  and m.embedding_dim == token.embedding_dim]
        position = others[0] if len(others) == 1 else None
    names = {id(p): n for n, p in model.named_parameters()}
    return (names.get(id(token.weight)) if token is not None else None,
            names.get(id(position.weight)) if isinstance(position, nn.Embedding) else None)


def next_token_labels(tokens: Tensor, ignore: int = -100) -> Tensor:
    """The causal-LM targets of ``tokens`` (N, L): position t predicts token t+1; the last position has no
    target (``ignore``, skipped by the loss as in Hugging Face's models)."""
    labels = torch.full_like(tokens, ignore)
    labels[:, :-1] = tokens[:, 1:]
    return labels
