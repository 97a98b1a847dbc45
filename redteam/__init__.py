"""The red team, installed as ``guardfl.redteam``: client simulation, attacks, metrics, certification.

The engine arrives with the red-team issues; this package reserves the namespace.
"""
