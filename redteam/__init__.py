"""The red team, installed as ``guardfl.redteam``: client simulation, attacks, metrics, certification of
a described client or of the user's own client code (``target``: a Flower ClientApp or a train_fn).

>>> from guardfl.redteam import simulate_client, FedSGD, ThreatModel, attacks, metrics
"""

from guardfl.redteam import attacks, metrics
from guardfl.redteam.capture import TrainingCapture
from guardfl.redteam.client import FedAvg, FedSGD, Observation, SideKnowledge, simulate_client
from guardfl.redteam.target import TargetError
from guardfl.redteam.threat import Knowledge, ThreatModel

__all__ = [
    "FedAvg",
    "FedSGD",
    "Knowledge",
    "Observation",
    "SideKnowledge",
    "TargetError",
    "ThreatModel",
    "TrainingCapture",
    "attacks",
    "metrics",
    "simulate_client",
]
