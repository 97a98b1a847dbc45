"""The attack runner: one job (an attack against one or more private batches) from budget to record:
build the attack, prepare it once per plan (from the cache when a killed run already did), reconstruct,
measure, and write the record the certificate lists.

Any error of the attack is an ``AttackFailed`` (the run fails), never a skipped row.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any, Mapping

import torch

from guardfl.errors import GuardflError
from guardfl.inspect import inspect_model
from guardfl.redteam import attacks as attack_registry
from guardfl.redteam.attacks.analytic.encoded import attack_view, decode, encoding_of, public_set
from guardfl.redteam.attacks.malicious import encoded_rounds
from guardfl.redteam.attacks.base import AttackFailed, PreparedCache, Setting
from guardfl.redteam.attacks.malicious.server import ServerAttack, refused_reconstruction
from guardfl.redteam.auxdata import AuxData
from guardfl.redteam.certification.measure import encoding_metrics, measure, recovered
from guardfl.redteam.certification.plan import record_name
from guardfl.redteam.certification.state import StateCache
from guardfl.redteam.client.simulate import ClientQuery, Observation, first_batch
from guardfl.redteam.config import AttackSection, RedTeamConfig
from guardfl.redteam.runtime.files import StateFolder
from guardfl.redteam.threat import inter_instahide


class AttackRunner:
    """Runs one (batch, attack) job: builds the attack with its budget, prepares it once per plan (from
    the cache when a killed run already did), reconstructs, measures. Any error of the attack is an
    ``AttackFailed`` (the run fails), never a skipped row. ``attacks``: name -> attack class (default: the
    registry)."""

    def __init__(self, cfg: RedTeamConfig, setting: Setting, aux: AuxData | None, device: torch.device,
                 progress: bool, state: StateFolder | None, attacks: Mapping[str, type] | None = None) -> None:
        self.cfg, self.setting, self.aux, self.device, self.progress = cfg, setting, aux, device, progress
        self.state = state
        self.attacks = attack_registry.ATTACKS if attacks is None else attacks
        self.cache = StateCache(state)
        self.preparations: dict[str, Any] = {}
        self.honest_refusals: dict[int, list[str] | None] = {}  # batch -> why the client refused the honest model

    def _prepared(self, key: str, info: dict[str, Any]) -> None:
        """A plan's preparation, as the run that made it recorded it (saved in the state), so that a
        resumed certificate says what the uninterrupted one says."""
        if key in self.preparations:
            return
        info = json.loads(json.dumps(info, default=str))
        if self.state is not None:
            saved = self.state.load_json(f"preparation-{key}.json")
            if saved is None:
                self.state.save_json(f"preparation-{key}.json", info)
            else:
                info = saved
        self.preparations[key] = info

    def complete(self, plans: list[AttackSection]) -> None:
        """After the jobs: the preparations of plans whose every job a killed run finished (this run did
        not prepare them) come from the state; all in plan order."""
        for i, plan in enumerate(plans):
            key = f"{i}-{plan.name}"
            if key not in self.preparations and self.state is not None:
                saved = self.state.load_json(f"preparation-{key}.json")
                if saved is not None:
                    self.preparations[key] = saved
        order = {f"{i}-{plan.name}": i for i, plan in enumerate(plans)}
        self.preparations = dict(sorted(self.preparations.items(), key=lambda kv: order.get(kv[0], len(order))))

    def prepare_only(self, i: int, plan: AttackSection) -> tuple[dict[str, Any], dict[str, Any]]:
        """Plan i's once-per-setting preparation alone (a worker's task): its prepared states (memory
        cache entries) and what it reported."""
        attack, _ = self._attack(plan, i, 0)
        cache, info = PreparedCache(), {}
        try:
            attack.prepare(self.setting, plan.threat.with_aux(self.aux), cache=cache,
                           on_done=info.update)
        except (KeyboardInterrupt, GuardflError):
            raise
        except Exception as err:
            raise AttackFailed(f"attack {plan.name} failed while preparing: {type(err).__name__}: {err}") from err
        return cache.entries(), info

    def adopt_preparation(self, i: int, plan: AttackSection, saved: dict[str, Any], info: dict[str, Any]) -> None:
        """A worker prepared plan i: keep its states (in the state folder too) and its record."""
        self.cache.adopt(saved)
        self._prepared(f"{i}-{plan.name}", info)

    def seed_of(self, cls: type, b: int) -> int:
        """Batch b's seed: a prepared attack keeps one seed for every batch (its preparation is shared);
        the others get a different seed per batch (different restarts)."""
        return self.cfg.seed if cls.capabilities.prepares else self.cfg.seed + b

    def _attack(self, plan: AttackSection, i: int, b: int):
        cls = self.attacks[plan.name]
        budget = {"seed": self.seed_of(cls, b), **plan.budget, "device": str(self.device), "progress": self.progress}
        return cls(**budget), budget

    def run(self, bs: tuple[int, ...], i: int, plan: AttackSection,
            items: list[tuple[Observation, torch.Tensor, torch.Tensor]]) -> list[tuple[dict, torch.Tensor]]:
        """Plan i against private batches ``bs`` (their observation, inputs, labels) in one
        ``reconstruct_many`` call: one (record, reconstruction) per batch, each seeded by its batch."""
        attack, budget = self._attack(plan, i, bs[0])
        seeds = [self.seed_of(type(attack), b) for b in bs]
        threat = plan.threat.with_aux(self.aux)
        where = f"client batch {bs[0]}" if len(bs) == 1 else f"client batches {bs[0]}-{bs[-1]}"
        t0 = time.time()
        out = []
        try:
            if attack.capabilities.prepares:
                # the first preparation of a plan is the one that trained (or loaded a killed run's state);
                # later batches reuse it from memory
                attack.prepare(self.setting, threat, cache=self.cache,
                               on_done=lambda info: self._prepared(f"{i}-{plan.name}", info))
            known = threat.defense == "known"
            # the client refused the honest model on some batches (``honest_refusal``): nothing was sent there,
            # nothing is attacked, and the record says why
            refusals = [None if isinstance(attack, ServerAttack) else self.honest_refusal(b, obs, x, y)
                        for b, (obs, x, y) in zip(bs, items)]
            kept = [k for k, why in enumerate(refusals) if not why]
            views, recs = [None] * len(items), [refused_reconstruction(self.setting, why) if why else None for why in refusals]
            sent, done = [items[k] for k in kept], []
            if sent and isinstance(attack, ServerAttack):  # models of the server's own making; reads of encodings decoded
                done, seen = self._interrogate(attack, sent, threat, [seeds[k] for k in kept], known)
                views = [seen[kept.index(k)] if k in kept else None for k in range(len(items))]
            elif sent and attack.capabilities.inverts_encodings:  # answers with the private images of an encoding client
                done = attack.reconstruct_many([obs for obs, _, _ in sent], threat, [seeds[k] for k in kept])
            elif sent:
                seen = [attack_view(obs, known) for obs, _, _ in sent]  # an input encoding: attack the encodings
                done = attack.reconstruct_many(seen, threat, [seeds[k] for k in kept])
                for k, view in zip(kept, seen):
                    views[k] = view
            for k, rec in zip(kept, done):
                recs[k] = rec
            seconds = (time.time() - t0) / len(bs)
            for b, seed, (obs, x, y), view, raw in zip(bs, seeds, items, views, recs):
                public = self.public_set() if view is not None and threat.public_data == "known" else None
                rec, encodings = decode(raw, obs, known, public=public) if view is not None else (raw, None)
                m = measure(self.cfg, rec, x, y, obs.input_range)
                record: dict[str, Any] = {
                    "job": record_name(b, i, plan), "batch": b, "attack": plan.name, "threat": plan.threat.as_config(),
                    "budget": {k: v for k, v in {**budget, "seed": seed}.items() if k != "progress"}}
                if encodings is not None and not isinstance(attack, ServerAttack):  # a query's encodings are its round's
                    record["encodings"] = encoding_metrics(encodings, obs, view)
                record["recovered"] = recovered(m, self.cfg)
                info = {k: (type(v).__name__ if isinstance(v, torch.nn.Module) else str(v)) for k, v in rec.info.items()}
                record.update(metrics=m, objective=rec.objective, restart_objectives=rec.restart_objectives,
                              info=info, seconds=seconds, batched_with=len(bs))
                # as the state file holds it: a job read back by a resume is this very record
                out.append((json.loads(json.dumps(record, default=str)), rec.inputs.detach().cpu()))
        except (KeyboardInterrupt, GuardflError) as err:
            if isinstance(err, KeyboardInterrupt):
                raise
            raise AttackFailed(f"attack {plan.name} failed on {where}: {err}") from err
        except Exception as err:
            raise AttackFailed(f"attack {plan.name} failed on {where}: {type(err).__name__}: {err}") from err
        return out

    def _interrogate(self, attack: ServerAttack, sent: list, threat, seeds: list, known: bool,
                     ) -> tuple[list, list[Observation | None]]:
        """A malicious server's queries of each batch's client, and the view its reads are decoded with (None:
        not decoded). Against an input encoding the server knows (MixUp, InstaHide) what its constructions
        read are the encodings the client trained on in that round: it reads them in the encodings' range
        (InstaHide's signs flip, [-m, m]), designs its models on its own images encoded the same way, collects
        the reads of many rounds (fresh encodings each) and demixes them as an honest attack's reconstructions
        are (``decode``; ``attacks.malicious.encoded_rounds``), never compared raw with the private images."""
        done, views = [], []
        for (obs, x, y), seed in zip(sent, seeds):
            view = attack_view(obs, known)  # the observation itself without a known encoding
            if view is obs:
                done.append(attack.interrogate(self._client_query(obs, x, y), self.setting, threat, seed))
                views.append(None)
                continue
            setting = dataclasses.replace(self.setting, input_range=view.input_range)
            enc = encoding_of(obs, known)
            coded = threat.with_aux(encoded_rounds.encoded_aux(threat.aux, enc, obs.num_classes, self.cfg.seed))
            rec = encoded_rounds.collect(attack, self._client_query(obs, x, y), setting, coded, seed,
                                         encoded_rounds.rounds_for(self.cfg.client.max_rounds))
            refused = rec.info.get("refused")  # nothing sent: the grey guess of the private images, not decoded
            done.append(refused_reconstruction(self.setting, [refused], rec.info) if refused else rec)
            views.append(None if refused else view)
        return done, views

    def public_set(self) -> torch.Tensor:
        """Inter-InstaHide's public set, as the defense's configuration names it (read once per runner): what
        an attacker under ``threat.public_data: known`` holds."""
        if getattr(self, "_public", None) is None:
            self._public = public_set(inter_instahide(self.setting.defense_config))
        return self._public

    def _client_query(self, obs: Observation, x: torch.Tensor, y: torch.Tensor) -> ClientQuery:
        """The simulated client of this batch as a malicious server reaches it (its private batch, the
        configured defense, the protocol and mode it was observed with)."""
        return ClientQuery(x, y, self.setting.defense_config, obs.protocol, input_range=obs.input_range,
                           train_mode=obs.train_mode, inspect=self.cfg.client.inspect, reference=self.setting.model,
                           disaggregation=self.cfg.client.inspect_disaggregation, leak_limit=self.cfg.client.inspect_leak_limit,
                           leak_history=self.cfg.client.leak_history_spec(), max_rounds=self.cfg.client.max_rounds)

    def honest_refusal(self, b: int, obs: Observation, x: torch.Tensor, y: torch.Tensor) -> list[str] | None:
        """Why the simulated client refuses the honest global model on batch ``b`` (None: it trains on it and
        sends ``obs``). An inspecting client inspects every model it receives, the honest one too; only
        the absolute ``client.inspect_leak_limit`` refuses it (the other checks judge a model against the
        client's architecture: the honest model passes them by construction, and the benign set measures
        none refused), so it is inspected where that limit is set. Once per batch and runner."""
        client = self.cfg.client
        if not client.inspect or client.inspect_leak_limit is None:
            return None
        if b not in self.honest_refusals:
            inspection = inspect_model(self.setting.model, self.setting.model, batch=first_batch(obs.protocol, x, y),
                                       disaggregation=client.inspect_disaggregation, leak_limit=client.inspect_leak_limit)
            self.honest_refusals[b] = None if inspection.ok else list(inspection.reasons)
        return self.honest_refusals[b]
