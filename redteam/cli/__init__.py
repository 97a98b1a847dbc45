"""Command lines: ``guardfl redteam`` and ``guardfl sweep``."""
