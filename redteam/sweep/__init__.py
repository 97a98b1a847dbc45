"""Sweeps: a grid (or autotuned line) of defense settings, each certified and trained for utility."""
