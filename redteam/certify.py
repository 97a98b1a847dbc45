"""Certification: simulate the deployed client, run every configured attack on what it transmits,
measure what comes back, and compare the worst case with the thresholds.

Each (client batch, attack) pair is one job whose result is written atomically under ``OUT/state/``;
``resume=True`` reuses finished jobs (same config hash) and runs only the rest. The client's
observation for a batch is saved too, so that a resumed run attacks the very update the first run saw.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

import guardfl
from guardfl.defenses import from_config
from guardfl.errors import ConfigError
from guardfl.redteam import attacks as attack_registry
from guardfl.redteam import data as data_mod
from guardfl.redteam import metrics
from guardfl.redteam.attacks.base import resolve_device
from guardfl.redteam.client import FedAvg, FedSGD, Observation, bn_layers, simulate_client
from guardfl.redteam.config import AttackSection, RedTeamConfig, ThreatSection, load_config
from guardfl.redteam.models import build_model, set_model_state
from guardfl.redteam.target import flower_run_config, load_object, observe, on_path, run_clientapp, run_train_fn
from guardfl.redteam.threat import ThreatModel

#: default budgets of ``attacks: all`` (CPU-friendly; raise them in the config for a GPU)
DEFAULT_BUDGETS: dict[str, dict[str, Any]] = {
    "dlg": {"iterations": 300},
    "idlg": {"iterations": 300},
    "inverting_gradients": {"iterations": 1000, "restarts": 4},
    "gradinversion": {"iterations": 1000, "restarts": 4, "group_every": 100},
}


@dataclass
class Certificate:
    certified: bool
    checks: list[dict[str, Any]]
    results: list[dict[str, Any]]
    config: dict[str, Any]
    config_hash: str
    environment: dict[str, Any]
    wall_time_s: float
    lpips: dict[str, Any]
    #: what was attacked: a simulated client, or the user's ClientApp / train_fn (per batch: steps, samples)
    client: dict[str, Any] = field(default_factory=dict)
    reconstructions: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    originals: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def verdict(self) -> str:
        return "CERTIFIED" if self.certified else "NOT CERTIFIED"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("reconstructions")
        d.pop("originals")
        d["verdict"] = self.verdict
        return d


def atomic_write(path: Path, data: bytes | str) -> None:
    """Write ``path`` so that a reader (or a killed run) never sees a partial file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "wb") as fh:
        fh.write(data.encode() if isinstance(data, str) else data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _atomic_torch_save(obj: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.close(fd)
    torch.save(obj, tmp)
    os.replace(tmp, path)


def plan_attacks(cfg: RedTeamConfig, has_bn: bool) -> list[AttackSection]:
    """The configured attacks, or for ``all`` every attack at the strongest threat: labels known, the
    defense's configuration known, BN statistics exact when the model has BatchNorm."""
    if cfg.attacks is not None:
        return list(cfg.attacks)
    threat = ThreatSection(labels="known", bn="exact" if has_bn else "none", defense="known", fedavg="known")
    plans = [AttackSection(name=name, budget=budget, threat=threat) for name, budget in DEFAULT_BUDGETS.items()]
    # iDLG's point is label restoration: run it with inferred labels
    plans[1] = AttackSection(name="idlg", budget=DEFAULT_BUDGETS["idlg"], threat=threat.model_copy(update={"labels": "inferred"}))
    return plans


def _protocol(cfg: RedTeamConfig):
    c = cfg.client
    if c.protocol == "fedsgd":
        return FedSGD()
    return FedAvg(epochs=c.epochs, batch_size=c.batch_size, lr=c.lr, momentum=c.momentum, weight_decay=c.weight_decay)


def _checks(cfg: RedTeamConfig, results: list[dict], lpips_available: bool) -> list[dict]:
    """Each threshold against the worst case (most leakage) over attacks and images."""
    c = cfg.certify
    specs = [("ssim", c.max_ssim, "max"), ("psnr", c.max_psnr, "max"), ("lpips", c.min_lpips, "min"), ("label_acc", c.max_label_acc, "max")]
    ran = [r for r in results if r.get("metrics")]
    checks = []
    for metric, threshold, kind in specs:
        if threshold is None:
            continue
        worst, where = None, None
        for r in ran:
            if metric == "label_acc":
                rows = [(r["metrics"]["summary"].get("label_acc"), None)]
            else:
                rows = [(p.get(metric), p["index"]) for p in r["metrics"]["per_image"]]
            for value, index in rows:
                if value is None:
                    continue
                leaks_more = worst is None or (value > worst if kind == "max" else value < worst)
                if leaks_more:
                    worst, where = value, {"batch": r["batch"], "attack": r["attack"], "image": index}
        check = {"metric": metric, "threshold": threshold, "rule": f"{'<=' if kind == 'max' else '>='} {threshold}",
                 "worst": worst, "where": where}
        if metric == "lpips" and not lpips_available:
            check.update(passed=False, note="LPIPS unavailable: the threshold cannot be verified")
        elif worst is None:
            check.update(passed=False, note="no attack produced this metric")
        else:
            check["passed"] = bool(worst <= threshold if kind == "max" else worst >= threshold)
        checks.append(check)
    if not ran:
        checks.append({"metric": "attacks", "passed": False, "note": "no attack could run against this client"})
    return checks


def certify(
    config: RedTeamConfig | dict | str | Path,
    *,
    out: str | Path | None = None,
    device: str | None = None,
    resume: bool = False,
    progress: bool = False,
) -> Certificate:
    """Run the red team described by ``config``; write results under ``out`` when given."""
    cfg = config if isinstance(config, RedTeamConfig) else load_config(config)
    started = time.time()
    dev = resolve_device(device or cfg.device)
    out_dir = Path(out) if out is not None else None
    state = out_dir / "state" if out_dir is not None else None
    digest = cfg.digest()
    if state is not None:
        _prepare_state(state, digest, resume)

    with on_path(cfg.target.app_dir if cfg.target is not None else None):
        source = _BatchSource(cfg, state)
        model = source.model
        plans = plan_attacks(cfg, bool(bn_layers(model)))
        results, recon, originals = [], {}, {}
        jobs = [(b, i, plan) for b in range(cfg.certify.batches) for i, plan in enumerate(plans)]
        bar = _bar(progress, len(jobs))
        for b, i, plan in jobs:
            job = f"b{b}-{i}-{plan.name}"
            done = _load_job(state, job) if state is not None else None
            if b not in originals:
                originals[b] = source.inputs(b)
            if done is not None:
                results.append(done[0])
                recon[job] = done[1]
                bar and bar.update(1)
                continue
            obs, x, y = source.batch(b)
            threat = ThreatModel(**plan.threat.model_dump())
            budget = {"seed": cfg.seed + b, **plan.budget, "device": str(dev), "progress": progress}
            attack = attack_registry.get(plan.name, **budget)
            record: dict[str, Any] = {"job": job, "batch": b, "attack": plan.name, "threat": plan.threat.model_dump(),
                                      "budget": {k: v for k, v in budget.items() if k != "progress"}}
            t0 = time.time()
            try:
                rec = attack.reconstruct(obs, threat)
            except ValueError as err:  # the attack does not apply to this setting
                record.update(skipped=str(err), seconds=time.time() - t0)
                rec = None
            if rec is not None:
                m = metrics.evaluate(rec, x, y, data_range=obs.input_range, lpips_weights=cfg.certify.lpips_weights)
                record.update(metrics=m, objective=rec.objective, restart_objectives=rec.restart_objectives,
                              info={k: str(v) for k, v in rec.info.items()}, seconds=time.time() - t0)
                recon[job] = rec.inputs.detach().cpu()
            if state is not None:
                _save_job(state, job, record, recon.get(job))
            results.append(record)
            bar and bar.update(1)
    bar and bar.close()

    lp = metrics.lpips_status(cfg.certify.lpips_weights)
    checks = _checks(cfg, results, lp.available)
    cert = Certificate(
        certified=all(c["passed"] for c in checks),
        checks=checks,
        results=results,
        client=source.describe(),
        config=cfg.model_dump(mode="json"),
        config_hash=digest,
        environment={
            "guardfl": guardfl.__version__, "torch": torch.__version__, "python": platform.python_version(),
            "device": str(dev), "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
        },
        wall_time_s=time.time() - started,
        lpips={"available": lp.available, "reason": lp.reason},
        reconstructions=recon,
        originals=originals,
    )
    if out_dir is not None:
        from guardfl.redteam.report import write_report

        atomic_write(out_dir / "certificate.json", json.dumps(cert.to_dict(), indent=2, default=str))
        write_report(cert, out_dir)
    return cert


def _prepare_state(state: Path, digest: str, resume: bool) -> None:
    marker = state / "config_hash"
    if resume and marker.is_file():
        found = marker.read_text().strip()
        if found != digest:
            raise ConfigError(f"--resume: {state} holds a run of another config (hash {found}, this one {digest}); "
                              "use another --out or drop --resume")
        return
    if state.exists():
        shutil.rmtree(state)
    state.mkdir(parents=True)
    atomic_write(marker, digest)


class _BatchSource:
    """Where each certified batch comes from: the simulated client (``simulate_client`` on the data
    section's images), or the user's ``target`` (a ClientApp fed the global model, or a train_fn fed the
    data section's images). Each batch's observation and ground truth are saved under ``OUT/state`` so a
    resumed run attacks the very update the first run saw."""

    def __init__(self, cfg: RedTeamConfig, state: Path | None) -> None:
        self.cfg, self.state = cfg, state
        self.target = cfg.target
        self._cache: dict[int, tuple[Observation, torch.Tensor, torch.Tensor]] = {}
        self._runs: dict[int, dict[str, Any]] = {}
        self.x_all = self.y_all = None
        if self.target is not None and self.target.clientapp is not None:
            in_shape = tuple(cfg.model.input_shape) if cfg.model.input_shape else None
            if in_shape is None and ":" not in cfg.model.name:
                raise ConfigError("model.input_shape: needed with a target.clientapp and a built-in model "
                                  "(or use model.name 'module:callable', the app's own model factory)")
        else:
            self._load_data()
            in_shape = tuple(self.x_all.shape[1:])
        self.model = build_model(cfg.model.name, in_shape, cfg.model.num_classes)
        set_model_state(self.model, cfg.model.state, seed=cfg.seed)
        if self.target is not None:
            self._client = self._load_client()

    def _load_data(self) -> None:
        cfg = self.cfg
        n = cfg.client.n
        need = cfg.data.offset + cfg.certify.batches * n
        self.x_all, self.y_all = data_mod.load(
            cfg.data.source, root=cfg.data.root, path=cfg.data.path, download=cfg.data.download,
            image_size=cfg.data.image_size, num_classes=cfg.model.num_classes, limit=need,
        )
        if len(self.x_all) < need:
            raise ConfigError(f"data: {cfg.data.source} has {len(self.x_all)} images; the config needs {need} "
                              f"(offset {cfg.data.offset} + {cfg.certify.batches} batches x {n} samples)")
        if int(self.y_all[:need].max()) >= cfg.model.num_classes:
            raise ConfigError(f"model.num_classes={cfg.model.num_classes} but the data has label {int(self.y_all.max())}")

    def _load_client(self):
        t = self.target
        if t.clientapp is not None:
            return load_object(t.clientapp, "target.clientapp")
        return load_object(t.train_fn, "target.train_fn")

    def _private(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.cfg.client.n
        lo = self.cfg.data.offset + b * n
        return self.x_all[lo : lo + n], self.y_all[lo : lo + n]

    def inputs(self, b: int) -> torch.Tensor:
        """The batch's private images (for the report), without simulating the client when not needed."""
        return self._private(b)[0] if self.target is None else self.batch(b)[1]

    def batch(self, b: int) -> tuple[Observation, torch.Tensor, torch.Tensor]:
        if b in self._cache:
            return self._cache[b]
        path = self.state / f"observation-b{b}.pt" if self.state is not None else None
        if path is not None and path.is_file():
            saved = torch.load(path, map_location="cpu", weights_only=False)  # our own file, from this run
            self._runs[b] = saved.get("run", {})
            self._cache[b] = (saved["observation"], saved["inputs"], saved["labels"])
            return self._cache[b]
        cfg = self.cfg
        if self.target is None:
            x, y = self._private(b)
            defense = from_config(cfg.defense) if cfg.defense is not None else None
            obs = simulate_client(self.model, x, y, defense, _protocol(cfg), train_mode=cfg.client.train_mode)
            self._runs[b] = {"kind": "simulated", "samples": int(x.shape[0])}
        else:
            obs, x, y = self._run_target(b)
        if path is not None:
            _atomic_torch_save({"observation": obs, "inputs": x, "labels": y, "run": self._runs[b]}, path)
        self._cache[b] = (obs, x, y)
        return self._cache[b]

    def _run_target(self, b: int) -> tuple[Observation, torch.Tensor, torch.Tensor]:
        t, cfg = self.target, self.cfg
        protocol = _protocol(cfg)
        if t.clientapp is not None:
            node_config = dict(t.node_config)
            if t.partition_key:
                node_config.setdefault(t.partition_key, b)
            run_config = flower_run_config(t.app_dir, t.run_config)
            returned, steps = run_clientapp(self._client, self.model, config=t.config, node_config=node_config,
                                            run_config=run_config)
            field_name, extra = "target.clientapp", {"node_config": node_config}
        else:
            x, y = self._private(b)
            returned, steps = run_train_fn(self._client, self.model, x, y, cfg.client.batch_size)
            field_name, extra = "target.train_fn", {}
        declared = cfg.client.samples if "samples" in cfg.client.model_fields_set else None
        run = observe(self.model, returned, steps, protocol, cfg.defense, field_name, declared)
        self._runs[b] = {"kind": field_name.split(".")[1], "ref": t.clientapp or t.train_fn, "samples": int(run.inputs.shape[0]),
                         "steps": run.steps, "batch_sizes": run.batch_sizes, **extra}
        return run.observation, run.inputs, run.labels

    def describe(self) -> dict[str, Any]:
        if self.target is None:
            kind = "simulated"
            note = "the red team ran guardfl's client simulation with the configured defense"
        else:
            kind = "clientapp" if self.target.clientapp else "train_fn"
            note = ("the red team ran the user's own client code; the configured defense is what the attacker "
                    "is told the client runs (the client applies its own)")
        return {"kind": kind, "ref": self.target and (self.target.clientapp or self.target.train_fn), "note": note,
                "batches": {str(b): r for b, r in sorted(self._runs.items())}}


def _load_job(state: Path, job: str):
    meta, tensor = state / f"{job}.json", state / f"{job}.pt"
    if not meta.is_file():
        return None
    record = json.loads(meta.read_text())
    rec = torch.load(tensor, map_location="cpu") if tensor.is_file() else None
    if record.get("metrics") is not None and rec is None:
        return None
    return record, rec


def _save_job(state: Path, job: str, record: dict, rec: torch.Tensor | None) -> None:
    if rec is not None:
        _atomic_torch_save(rec, state / f"{job}.pt")
    atomic_write(state / f"{job}.json", json.dumps(record, default=str))  # written last: marks the job done


def _bar(enabled: bool, total: int):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="red team", unit="attack")
