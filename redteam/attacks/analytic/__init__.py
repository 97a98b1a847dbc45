"""Analytic attacks: Cocktail Party (ICA), and demixing of encoded (MixUp / InstaHide) batches."""
