"""Learned inversion: an inverter trained on auxiliary data (Wu et al. 2023), images and text."""
