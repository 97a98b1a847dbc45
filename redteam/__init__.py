"""The red team, installed as ``guardfl.redteam``: client simulation, attacks, metrics, certification of
a described client or of the user's own client code (``target``: a Flower ClientApp or a train_fn).

>>> from guardfl.redteam import simulate_client, FedSGD, ThreatModel, attacks, metrics, certify

``certify`` is the entry point (``guardfl redteam`` runs it): a config in, a ``Certificate`` out.

>>> cert = certify({"model": {"name": "lenet", "state": "wide-init"}, "data": {"source": "lfw-faces", "limit": 4},
...                 "attacks": [{"name": "idlg", "budget": {"iterations": 20}}], "certify": {"max_updates": 2}})
>>> cert.verdict in ("CERTIFIED", "NOT CERTIFIED", "INCONCLUSIVE"), cert.bound["status"]
(True, 'NO MECHANISM')

Subpackages (the architecture): ``certification`` (the run's recipe, plan, batches, judge, certificate),
``attacks`` (by family), ``client`` (protocols, simulation, targets), ``modality`` (images and text),
``sweep``, ``reports``, ``runtime`` (state folder, workers, Ray) and ``cli``.
"""

from guardfl.redteam import attacks
from guardfl.redteam.certification.certificate import Certificate
from guardfl.redteam.certification.run import certify
from guardfl.redteam.client.capture import TrainingCapture
from guardfl.redteam.client.simulate import FedAvg, FedSGD, Observation, SideKnowledge, simulate_client
from guardfl.redteam.client.target import TargetError
from guardfl.redteam.modality.image import metrics
from guardfl.redteam.runtime.ray_backend import RayJobs
from guardfl.redteam.threat import Knowledge, ThreatModel

__all__ = [
    "Certificate",
    "FedAvg",
    "FedSGD",
    "Knowledge",
    "Observation",
    "RayJobs",
    "SideKnowledge",
    "TargetError",
    "ThreatModel",
    "TrainingCapture",
    "attacks",
    "certify",
    "metrics",
    "simulate_client",
]
