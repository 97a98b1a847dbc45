"""Text: corpora, language models, tokenizers and metrics."""
