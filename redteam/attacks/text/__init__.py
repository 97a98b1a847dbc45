"""Text attacks: TAG and the embedding read-out."""
