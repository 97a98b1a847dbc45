"""The batches a run certifies: the private samples drawn from the population, the client that trains on
them (guardfl's simulation, or the user's ClientApp / train_fn / NVFlare job), and the observation it
transmits, saved under ``OUT/state`` so that a resumed run attacks the very update the first run saw; with
the attacker's auxiliary data (refused when it overlaps the private batches) and prior guess.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from guardfl.defenses import from_config
from guardfl.errors import ConfigError
from guardfl.inspect import CHECKS, DSNR_MIN_BATCH, DSNR_THRESHOLD
from guardfl.redteam.attacks.base import Setting
from guardfl.redteam.auxdata import AuxData
from guardfl.redteam.certification.sampling import Population
from guardfl.redteam.certification.state import pack_observation, unpack_observation
from guardfl.redteam.client import privacy
from guardfl.redteam.client.simulate import FedAvg, FedSGD, Observation, simulate_client
from guardfl.redteam.client.target import (flower_run_config, load_object, nvflare_result_filters, observe, run_clientapp,
                                           run_nvflare, run_train_fn)
from guardfl.redteam.config import RedTeamConfig
from guardfl.redteam import modality
from guardfl.redteam.modality.image.models import build_model, set_model_state
from guardfl.redteam.runtime.files import StateFolder


def read_section(m: modality.Modality, section: Any, limit: int | None, **options: Any) -> tuple[Any, Any, list[int]]:
    """A source section's samples from its ``offset``, at most ``limit`` (None: all), and their indices in
    the source: in the source's stored order, or with ``shuffle`` (a seed) in that seeded random order of
    the whole source (which is then read whole)."""
    stop = section.offset + limit if limit else None
    if section.shuffle is None:
        x, y = m.load(section, limit=stop, **options)
        index = torch.arange(len(x))
    else:
        x, y = m.load(section, limit=None, **options)
        index = torch.randperm(len(x), generator=torch.Generator().manual_seed(section.shuffle))
    index = index[section.offset : stop]
    return x[index], y[index], index.tolist()


def load_aux(cfg: RedTeamConfig) -> AuxData | None:
    """The attacker's auxiliary data from the config's ``aux`` section (None without one): text is read with
    the client's tokenizer and sequence length, for the task the source's samples feed."""
    a = cfg.aux
    if a is None:
        return None
    k, d, m = cfg.model.num_classes, cfg.data, modality.of(cfg)

    def take(section, limit):
        x, y, _ = read_section(m, section, limit, num_classes=k, field="aux", image_size=d.image_size,
                               seq_len=d.seq_len, tokenizer=d.tokenizer)
        if not len(x):
            raise ConfigError(f"aux: {section.source} has no {m.units} from offset {section.offset}")
        return x, y

    images, labels = (take(a, a.limit) if a.source is not None else (torch.zeros(0), torch.zeros(0, dtype=torch.long)))
    ood = take(a.ood, a.ood.limit)[0] if a.ood is not None else None
    if len(labels) and m.class_labels and int(labels.max()) >= k:
        raise ConfigError(f"aux: {a.source} has label {int(labels.max())} but model.num_classes={k}")
    return AuxData(images, labels, ood=ood, ood_samples=a.ood.samples if a.ood is not None else 0,
                   name=f"{a.source or ''}{'+ood:' + a.ood.source if a.ood else ''}")


def _protocol(cfg: RedTeamConfig):
    """The configured client's protocol (FedSGD, or FedAvg with its hyperparameters)."""
    c = cfg.client
    if c.protocol == "fedsgd":
        return FedSGD()
    return FedAvg(epochs=c.epochs, batch_size=c.batch_size, lr=c.lr, momentum=c.momentum, weight_decay=c.weight_decay)


def prior_guess(aux: AuxData | None) -> torch.Tensor | None:
    """The attacker's best guess without looking at the update: the mean auxiliary image (in-distribution
    images when it has them, else its OOD images). None without auxiliary data."""
    if aux is None:
        return None
    if not aux.images.is_floating_point():  # token ids: the most frequent auxiliary token at each position
        return aux.images.mode(0).values if len(aux.images) else None
    return (aux.images if len(aux.images) else aux.ood).mean(0)


class BatchSource:
    """Where each certified batch comes from: the simulated client (``simulate_client`` on the data
    section's images), or the user's ``target`` (a ClientApp fed the global model, or a train_fn fed the
    data section's images). Each batch's observation and ground truth are saved under ``OUT/state`` so a
    resumed run attacks the very update the first run saw. Auxiliary data that shares an image with any
    private batch is refused (content hashes): up front for simulated clients, per batch for targets."""

    def __init__(self, cfg: RedTeamConfig, state: StateFolder | None, aux: AuxData | None = None) -> None:
        self.cfg, self.state, self.aux = cfg, state, aux
        self.target = cfg.target
        #: the configured defense with DP-SGD's noise resolved for the deployment, and its accounting
        self.defense_config, self.privacy = privacy.resolve(cfg.defense, cfg.client.batch_size, cfg.client.dataset_size)
        self._cache: dict[int, tuple[Observation, torch.Tensor, torch.Tensor]] = {}
        self._runs: dict[int, dict[str, Any]] = {}
        self.x_all = self.y_all = None
        #: the population the certificate speaks for (None: a target that brings its own data), and each
        #: update's drawn samples (indices into x_all), drawn when the update is first observed
        self._population: Population | None = None
        self.updates: dict[int, list[int]] = {}
        self._open(aux)

    def _open(self, aux: AuxData | None) -> None:
        """The model, the population and the drawn samples (which the auxiliary data must not share), and a
        target's client code. A model built before its data (text: its task picks the samples,
        ``Modality.client_model``) comes first; otherwise the data's shape builds it, and a ClientApp /
        NVFlare target, which brings its own data, declares the model's input shape."""
        cfg, m = self.cfg, modality.of(self.cfg)
        model = m.client_model(cfg.model.name, cfg.model.num_classes, tokenizer=cfg.data.tokenizer, seq_len=cfg.data.seq_len)
        if self.target is not None and (self.target.clientapp is not None or self.target.nvflare is not None):
            in_shape = tuple(cfg.model.input_shape) if cfg.model.input_shape else None
            if in_shape is None and ":" not in cfg.model.name:
                raise ConfigError("model.input_shape: needed with a target.clientapp / target.nvflare and a built-in model "
                                  "(or use model.name 'module:callable', the app's own model factory)")
        else:
            self._load_data(m, task=getattr(model, "task", None))
            in_shape = tuple(self.x_all.shape[1:])
            if aux is not None:
                aux.check_disjoint(self.x_all)  # the whole population: any update may draw any of it
        self.model = model if model is not None else build_model(cfg.model.name, in_shape, cfg.model.num_classes)
        set_model_state(self.model, cfg.model.state, seed=cfg.seed)
        if self.target is not None:
            self._client = self._load_client()

    def _load_data(self, m: modality.Modality, task: str | None = None) -> None:
        """The population (the data section's samples from ``offset``, ``limit`` of them; a text model's
        sequences for its ``task``), from which every update draws its ``n`` private samples at random
        (``sampling``)."""
        cfg = self.cfg
        d = cfg.data
        n = cfg.client.n
        self.x_all, self.y_all, index = read_section(m, d, d.limit, num_classes=cfg.model.num_classes, task=task,
                                                     seq_len=d.seq_len, tokenizer=d.tokenizer)
        population = Population(d.source, d.offset, len(self.x_all), d.path, d.shuffle, tuple(index))
        if population.size < n:
            raise ConfigError(f"data: {d.source} has {population.size} {m.units} from offset {d.offset}"
                              f"{f' (limit {d.limit})' if d.limit else ''}; one client update of {n} samples needs "
                              f"{n} distinct ones (a smaller client, or a larger population)")
        if m.class_labels and int(self.y_all.max()) >= cfg.model.num_classes:
            raise ConfigError(f"model.num_classes={cfg.model.num_classes} but the data has label {int(self.y_all.max())}")
        self._population = population

    @property
    def population(self) -> dict[str, Any]:
        """The certificate's ``population`` entry (empty for a target that brings its own data): what the
        claim is about, and each attacked update's samples."""
        if self._population is None:
            return {}
        return self._population.describe(self.updates, self.cfg.seed)

    def drawn(self, b: int) -> list[int]:
        """Update ``b``'s samples: indices into the population (``Population.draw_update``)."""
        if b not in self.updates:
            self.updates[b] = self._population.draw_update(b, self.cfg.client.n, self.cfg.seed)
        return self.updates[b]

    def _load_client(self):
        t = self.target
        if t.clientapp is not None:
            return load_object(t.clientapp, "target.clientapp")
        if t.nvflare is not None:
            self._result_filters = nvflare_result_filters(t.job, t.result_filters)
            return load_object(t.nvflare, "target.nvflare")
        return load_object(t.train_fn, "target.train_fn")

    def _private(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.drawn(b)
        return self.x_all[rows], self.y_all[rows]

    def batch(self, b: int) -> tuple[Observation, torch.Tensor, torch.Tensor]:
        if b in self._cache:
            return self._cache[b]
        name = f"observation-b{b}.pt"
        saved = self.state.load_tensors(name) if self.state is not None else None
        if saved is not None:
            if self._population is not None:
                self.drawn(b)  # the certificate lists every attacked update's samples
            self._runs[b] = saved["run"]
            self._cache[b] = (unpack_observation(saved["observation"], self.model), saved["inputs"], saved["labels"])
            return self._cache[b]
        cfg = self.cfg
        if self.target is None:
            x, y = self._private(b)
            defense = from_config(self.defense_config) if self.defense_config is not None else None
            obs = simulate_client(self.model, x, y, defense, _protocol(cfg), train_mode=cfg.client.train_mode)
            self._runs[b] = {"kind": "simulated", "samples": int(x.shape[0])}
        else:
            obs, x, y = self._run_target(b)
            if self.aux is not None:
                self.aux.check_disjoint(x, obs.input_range)
        self._runs[b] = json.loads(json.dumps(self._runs[b], default=str))  # as a resume reads it back
        if self.state is not None:
            self.state.save_tensors(name, {"observation": pack_observation(obs), "inputs": x, "labels": y,
                                           "run": self._runs[b]})
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
        elif t.nvflare is not None:
            site = f"site-{b + 1}"
            returned, steps = run_nvflare(self._client, self.model, site=site, kwargs=t.run_config,
                                          filters=self._result_filters)
            field_name = "target.nvflare"
            extra = {"site": site, "result_filters": [type(f).__name__ for f in self._result_filters]}
        else:
            x, y = self._private(b)
            returned, steps = run_train_fn(self._client, self.model, x, y, cfg.client.batch_size)
            field_name, extra = "target.train_fn", {}
        declared = cfg.client.samples if "samples" in cfg.client.model_fields_set else None
        run = observe(self.model, returned, steps, protocol, cfg.defense, field_name, declared)
        self._runs[b] = {"kind": field_name.split(".")[1], "ref": t.clientapp or t.train_fn or t.nvflare, "samples": int(run.inputs.shape[0]),
                         "steps": run.steps, "batch_sizes": run.batch_sizes, **extra}
        return run.observation, run.inputs, run.labels

    def setting(self) -> Setting:
        """What every batch shares (model, protocol, geometry, the defense as configured): from batch 0."""
        obs = self.batch(0)[0]
        return Setting.of(obs)

    def describe(self) -> dict[str, Any]:
        if self.target is None:
            kind = "simulated"
            note = ("the red team ran guardfl's client simulation with the configured defense"
                    if self.cfg.defense is not None else "the red team ran guardfl's client simulation without a defense (defense: null)")
        else:
            kind = "clientapp" if self.target.clientapp else "nvflare" if self.target.nvflare else "train_fn"
            note = ("the red team ran the user's own client code; the configured defense is what the attacker "
                    "is told the client runs (the client applies its own)")
        out = {"kind": kind, "ref": self.target and (self.target.clientapp or self.target.train_fn or self.target.nvflare), "note": note,
               "batches": {str(b): r for b, r in sorted(self._runs.items())}}
        if self.target is None and self.cfg.client.inspect:
            out["inspection"] = inspection_summary(self.cfg.client.inspect_disaggregation, self.cfg.client.inspect_leak_limit,
                                                     self.cfg.client.leak_history_spec())
        return out


def inspection_summary(disaggregation: bool, leak_limit: int | None = None, leak_history: bool | dict = True) -> dict[str, Any]:
    """What an inspecting simulated client runs on every model a malicious server sends, and with
    ``leak_limit`` on the honest one too (the certificate's ``client.inspection``): ``inspect_model``,
    strict, with the honest global model as the reference and its own first batch; the checks, and the
    opt-in checks left out when they are."""
    checks = list(CHECKS)
    summary: dict[str, Any] = {"function": "guardfl.inspect_model", "strict": True,
                               "reference": "the honest global model", "batch": "the client's first batch",
                               "disaggregation": disaggregation, "leak_limit": leak_limit}
    not_run = []
    if disaggregation:
        checks.append("disaggregation")
        summary["disaggregation_rule"] = (f"SEER's D-SNR (Garov et al. 2024), train mode: refused above {DSNR_THRESHOLD:g} "
                                          f"on batches of {DSNR_MIN_BATCH} or more")
    else:
        not_run.append("disaggregation (SEER's D-SNR, opt-in: client.inspect_disaggregation: true)")
    if leak_limit is not None:
        checks.append("leak_limit")
        summary["leak_limit_rule"] = (f"any model, the honest one too, with which a server reads more than {leak_limit} "
                                      f"samples of the first batch from the update's linear layers (the isolation "
                                      f"check's count) is refused")
        summary["leak_limit_scope"] = (
            "with history: this update, its difference with every earlier update the client sent on the same batch, "
            "where two views of those updates meet in one sample (and a line two share meets a third), and what those "
            "gave away, together (LeakHistory; not views of rank above half the batch, nor reads by image priors)"
            + (f"; limits {dict(leak_history)}" if isinstance(leak_history, dict) else "") if leak_history else
            "per update only: the client keeps no history between rounds (client.inspect_leak_history: false), and a "
            "server that differences two updates of one batch reads past the limit")
    else:
        not_run.append("leak_limit (an absolute limit that refuses the honest model's own leak too, opt-in: "
                       "client.inspect_leak_limit: k)")
    if not_run:
        summary["not_run"] = not_run
    summary["checks"] = checks
    return summary
