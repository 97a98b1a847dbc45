"""The red team, installed as ``guardfl.redteam``: client simulation, attacks, metrics.

>>> from guardfl.redteam import simulate_client, FedSGD, ThreatModel, attacks, metrics
"""

from guardfl.redteam import attacks, metrics
from guardfl.redteam.client import FedAvg, FedSGD, Observation, SideKnowledge, simulate_client
from guardfl.redteam.threat import Knowledge, ThreatModel

__all__ = [
    "FedAvg",
    "FedSGD",
    "Knowledge",
    "Observation",
    "SideKnowledge",
    "ThreatModel",
    "attacks",
    "metrics",
    "simulate_client",
]
