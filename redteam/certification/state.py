"""The resume codec: the run's state folder (opened fresh or resumed under the run's key), each job's
record and reconstruction, each batch's observation, and the prepared attack states, as files.

Each (client batch, attack) job's result is written atomically under ``OUT/state/``; ``resume=True``
reuses finished jobs and prepared attacks. A resume needs the same key: the config's hash AND the content
of every file the run reads (``fingerprint``); the state holds only JSON and tensors (read with
``weights_only=True``), listed in its manifest (``files.StateFolder``).
"""

from __future__ import annotations

import copy
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from guardfl.defenses import parse_config
from guardfl.errors import ConfigError
from guardfl.redteam.attacks.base import PreparedCache
from guardfl.redteam import modality
from guardfl.redteam.certification.fingerprint import changed_inputs, resume_key, run_inputs
from guardfl.redteam.client.simulate import FedAvg, FedSGD, Observation, SideKnowledge
from guardfl.redteam.config import RedTeamConfig
from guardfl.redteam.runtime.files import StateFolder


def open_state(root: Path, cfg: RedTeamConfig, config_hash: str, inputs: dict[str, str], resume: bool) -> StateFolder:
    """The run's state folder. ``resume``: the earlier run's, when its key (config hash and the content of
    every input) is this run's, else a ConfigError of one line naming what changed. Otherwise (or with no
    earlier state) a fresh one: the files an earlier guardfl run listed are removed, nothing else, and a
    folder of files guardfl did not write is refused."""
    key = resume_key(config_hash, inputs)
    manifest = StateFolder.read_manifest(root) if resume else None
    if manifest is not None:
        old = manifest.get("meta") or {}
        if old.get("key") == key:
            return StateFolder.reopen(root, manifest)
        if old.get("config_hash") != config_hash:
            raise ConfigError(f"--resume: {root} holds a run of another config (hash {old.get('config_hash')}, this one "
                              f"{config_hash}); use another --out or drop --resume")
        paths = run_inputs(cfg)
        changed = [f"{name} ({paths[name][0]})" if name in paths and paths[name][0] else name
                   for name in changed_inputs(old.get("inputs") or {}, inputs)]
        raise ConfigError(f"--resume: {', '.join(changed) or 'an input file'} changed since the run in {root} (content "
                          "hash); resuming would mix two versions in one certificate; use another --out or drop --resume")
    return StateFolder.fresh(root, {"key": key, "config_hash": config_hash, "inputs": inputs})


def pack_observation(obs: Observation) -> dict[str, Any]:
    """An observation as tensors and plain data (the global model as its state dict and train flags)."""
    side = obs.side
    return {
        "protocol": asdict(obs.protocol),
        "model": {"state": dict(obs.model.state_dict()), "training": [m.training for m in obs.model.modules()]},
        "update": dict(obs.update), "num_samples": obs.num_samples, "input_shape": tuple(obs.input_shape),
        "num_classes": obs.num_classes, "input_range": tuple(obs.input_range), "defense_config": None if obs.defense_config is None else obs.defense_config.model_dump(mode="json"),
        "released_bn_stats": [tuple(p) for p in obs.released_bn_stats],
        "side": {"labels": side.labels, "bn_batch_stats": [tuple(p) for p in side.bn_batch_stats],
                 "defense_stats": json.loads(json.dumps(list(side.defense_stats), default=str)),  # logs
                 "input_hashes": tuple(side.input_hashes),
                 "trained": [tuple(p) for p in side.trained]},
        "train_mode": obs.train_mode, "modality": obs.modality,
    }


def unpack_observation(d: dict[str, Any], model: torch.nn.Module) -> Observation:
    """The observation ``pack_observation`` saved; ``model``: the run's global model (architecture),
    copied and given the saved state."""
    proto = dict(d["protocol"])
    protocol = FedSGD() if proto.get("name") == "fedsgd" else FedAvg(**proto)
    global_model = copy.deepcopy(model)
    global_model.load_state_dict(d["model"]["state"], strict=True)
    modules = list(global_model.modules())
    if len(modules) != len(d["model"]["training"]):
        raise ConfigError("--resume: a saved observation does not match this run's model; drop --resume to start over")
    for module, training in zip(modules, d["model"]["training"]):
        module.training = bool(training)
    side = d["side"]
    return Observation(
        protocol=protocol, model=global_model, update=dict(d["update"]), num_samples=d["num_samples"],
        input_shape=tuple(d["input_shape"]), num_classes=d["num_classes"], input_range=tuple(d["input_range"]),
        defense_config=None if d["defense_config"] is None else parse_config(d["defense_config"]), released_bn_stats=[tuple(p) for p in d["released_bn_stats"]],
        side=SideKnowledge(labels=side["labels"], bn_batch_stats=[tuple(p) for p in side["bn_batch_stats"]],
                           defense_stats=list(side["defense_stats"]), input_hashes=tuple(side["input_hashes"]),
                           trained=[tuple(p) for p in side["trained"]]),
        train_mode=d["train_mode"], modality=d.get("modality", modality.DEFAULT),
    )


def load_job(state: StateFolder, job: str):
    """A finished job's (record, reconstruction) from the state, None when it is not (wholly) there."""
    record = state.load_json(f"{job}.json")
    if record is None:
        return None
    rec = state.load_tensors(f"{job}.pt")
    if record.get("metrics") is not None and rec is None:
        return None
    return record, rec


def save_job(state: StateFolder, job: str, record: dict, rec: torch.Tensor | None) -> None:
    """A job's result into the state: its reconstruction, then its record (which marks it done)."""
    if rec is not None:
        state.save_tensors(f"{job}.pt", rec)
    state.save_json(f"{job}.json", record)  # written last: marks the job done


class StateCache(PreparedCache):
    """Prepared attack states in the run's state folder (``prepared/NAME-KEY.pt``): listed in its
    manifest, tensors and plain data only, read back with ``weights_only=True``."""

    def __init__(self, state: StateFolder | None) -> None:
        super().__init__(None)
        self.state = state

    def read(self, entry: str) -> Any | None:
        return self.state.load_tensors(f"prepared/{entry}.pt") if self.state is not None else None

    def write(self, entry: str, state: Any) -> None:
        if self.state is not None:
            self.state.save_tensors(f"prepared/{entry}.pt", state)

    def adopt(self, entries: dict[str, Any]) -> None:
        """Take states another process prepared, and store them in the state folder."""
        for entry, state in entries.items():
            super().adopt({entry: state})
            self.write(entry, state)

    def entries_of(self, name: str) -> dict[str, Any]:
        """Prepared states of attack ``name`` this run holds (memory, or listed in the state folder)."""
        found = {k: v for k, v in self.entries().items() if k.startswith(f"{name}-")}
        if self.state is not None:
            for file in self.state.files:
                if file.startswith(f"prepared/{name}-") and file.endswith(".pt"):
                    entry = file.removeprefix("prepared/").removesuffix(".pt")
                    if entry not in found:
                        loaded = self.state.load_tensors(file)
                        if loaded is not None:
                            found[entry] = loaded
        return found
