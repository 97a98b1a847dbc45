"""The sections of the red-team config (model, data, auxiliary data, client, attacks, target, certify),
each validated on its own; ``config.RedTeamConfig`` combines them and checks them against each other."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from guardfl.config import StrictModel
from guardfl.integrations.budget import MAX_ROUNDS_LIMIT
from guardfl.redteam.modality import DATA_SOURCES
from guardfl.redteam.threat import ThreatModel


class ModelSection(StrictModel):
    #: a built-in model, or 'module:callable' returning your nn.Module (code that runs)
    name: str = Field(default="lenet", json_schema_extra={"allowed": "lenet, fc2, fc2bn, fc2gn, fc2ln, convnet, resnet18, resnet20, vgg16, "
                      "transformer3, transformer3-tied, text-classifier or module:callable"})
    #: the input shape (C, H, W) when no data section gives it (a target.clientapp loads its own data)
    input_shape: list[int] | None = Field(default=None, min_length=3, max_length=3,
                                          json_schema_extra={"allowed": "null or [C, H, W] with C in [1, 16], H and W in [4, 1024]"})
    #: the classifier's classes (for a text model: ignored, the vocabulary decides)
    num_classes: int = Field(default=10, ge=2, le=100_000, json_schema_extra={"allowed": "an integer in [2, 100000]"})
    #: the weights the server sends: PyTorch's default init, the wide U(-0.5, 0.5) init of the DLG papers (the
    #: attacks' best case), or a checkpoint file
    state: str = Field(
        default="default",
        json_schema_extra={"allowed": "'default' (PyTorch init), 'wide-init' (worst case) or a checkpoint path"},
    )

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        if ":" in name:
            from guardfl.redteam.runtime.userref import UserCodeError, split_ref

            try:
                split_ref(name, "model.name")
            except UserCodeError as err:
                raise ValueError(str(err).removeprefix("model.name: ")) from None
        return name

    @field_validator("input_shape")
    @classmethod
    def _shape(cls, shape: list[int] | None) -> list[int] | None:
        if shape is not None and not (1 <= shape[0] <= 16 and all(4 <= s <= 1024 for s in shape[1:])):
            raise ValueError(f"expected [C, H, W] with C in [1, 16], H and W in [4, 1024] (got {shape})")
        return shape


#: the data sources (``modality.SOURCES``, the one table: images, then text)
SourceName = Literal[DATA_SOURCES]  # type: ignore[valid-type]
_SOURCE_HELP = {"allowed": ", ".join(DATA_SOURCES)}


class _Source(StrictModel):
    """Where images come from (the same sources for private, auxiliary and OOD data)."""

    #: a folder for torchvision datasets (cifar10, ...)
    root: str | None = None
    #: a file for the npz / folder sources
    path: str | None = None
    #: let torchvision download a missing dataset (off by default: nothing is fetched unasked)
    download: bool = False
    #: resize the images to this many pixels a side (null: as stored)
    image_size: int | None = Field(default=None, ge=4, le=1024, json_schema_extra={"allowed": "null or an integer in [4, 1024]"})
    #: skip this many samples of the source first
    offset: int = Field(default=0, ge=0, json_schema_extra={"allowed": "an integer >= 0"})
    #: null: the source in its stored order; a seed: the whole source in that seeded random order before
    #: ``offset`` and ``limit`` apply. A file stored by class (the CIFAR-10 sample in ../shared/data) split
    #: by offsets gives the attacker and the client different classes; the same ``shuffle`` on both sections
    #: splits it into disjoint parts of the same classes
    shuffle: int | None = Field(default=None, ge=0, json_schema_extra={"allowed": "null (stored order) or an integer >= 0 (a seed)"})


class DataSection(_Source):
    """The client's private data: the POPULATION the certificate speaks for (``source`` from ``offset``,
    ``limit`` images, null: all of it). The certified samples are drawn from it at random (seeded by the
    config's ``seed``, recorded in the certificate), not taken from the front."""

    #: where the private samples come from (lfw-faces ships with scikit-image: no download)
    source: SourceName = Field(default="lfw-faces", json_schema_extra=_SOURCE_HELP)
    #: the population's size: samples from offset on (null: the rest of the source)
    limit: int | None = Field(default=None, ge=1, json_schema_extra={"allowed": "null (all) or an integer >= 1 (population size)"})
    #: text sources: tokens per private sample, the tokenizer, the split of a ``datasets`` name
    seq_len: int = Field(default=16, ge=2, le=4096, json_schema_extra={"allowed": "an integer in [2, 4096] (tokens)"})
    #: text: the tokenizer of the sequences
    tokenizer: str = Field(default="gpt2", min_length=1, json_schema_extra={
        "allowed": "'gpt2' (built in), a path to a tokenizer.json, or a Hugging Face tokenizer name already cached"})
    #: text: the split of a datasets name
    split: Literal["train", "validation", "test"] = Field(default="test", json_schema_extra={
        "allowed": "'train', 'validation' or 'test' (wikitext / cola)"})


class OODSection(_Source):
    """Out-of-distribution images of the attacker: used as they are (random labels) and to fit LTI-OOD's
    DCT Gaussian, from which ``samples`` pseudo-images are drawn (Wu et al. 2023, Sec. 4.1.3)."""

    #: where the out-of-distribution images come from
    source: SourceName = Field(json_schema_extra=_SOURCE_HELP)
    #: at most this many OOD images
    limit: int | None = Field(default=None, ge=2, json_schema_extra={"allowed": "null (all) or an integer >= 2"})
    #: pseudo-images drawn from the DCT Gaussian fitted on them (0: the images alone)
    samples: int = Field(default=2000, ge=0, le=100_000, json_schema_extra={"allowed": "an integer in [0, 100000] (pseudo-images)"})


class AuxSection(_Source):
    """The attacker's auxiliary data (public, disjoint from the client's private images: checked by content):
    in-distribution images (``source``, from ``offset``, at most ``limit``) and/or ``ood`` images."""

    #: where the attacker's in-distribution images come from (null: OOD images only)
    source: SourceName | None = Field(default=None, json_schema_extra={"allowed": "null (OOD only) or " + _SOURCE_HELP["allowed"]})
    #: at most this many auxiliary images
    limit: int | None = Field(default=None, ge=1, json_schema_extra={"allowed": "null (all) or an integer >= 1"})
    #: the attacker's out-of-distribution images (LTI-OOD)
    ood: OODSection | None = None
    #: text: the split of a ``datasets`` name (the tokenizer and sequence length are the data section's)
    split: Literal["train", "validation", "test"] = Field(default="train", json_schema_extra={
        "allowed": "'train', 'validation' or 'test' (wikitext / cola)"})

    @model_validator(mode="after")
    def _something(self) -> "AuxSection":
        if self.source is None and self.ood is None:
            raise ValueError("give in-distribution images (source) or OOD images (ood), or both")
        return self


class LeakHistoryLimits(StrictModel):
    """``client.inspect_leak_history`` as a mapping: the deployed client's ``LeakHistory`` limits."""

    #: a batch answered this many rounds is refused
    max_rounds: int = Field(default=256, ge=1, le=100_000, json_schema_extra={"allowed": "an integer in [1, 100000]"})
    #: the most batches the history keeps
    max_batches: int = Field(default=64, ge=1, le=100_000, json_schema_extra={"allowed": "an integer in [1, 100000]"})


class ClientSection(StrictModel):
    #: fedsgd: one gradient of one batch per update; fedavg: the model delta after local training
    protocol: Literal["fedsgd", "fedavg"] = Field(default="fedsgd", json_schema_extra={"allowed": "'fedsgd' or 'fedavg'"})
    #: samples per step (FedSGD: per update)
    batch_size: int = Field(default=1, ge=1, le=4096, json_schema_extra={"allowed": "an integer in [1, 4096]"})
    #: fedavg: the client's local dataset per round (null: one batch)
    samples: int | None = Field(default=None, ge=1, le=100_000, json_schema_extra={"allowed": "null (= batch_size) or an integer in [1, 100000]"})
    #: fedavg: local epochs per round
    epochs: int = Field(default=1, ge=1, le=1000, json_schema_extra={"allowed": "an integer in [1, 1000]"})
    #: fedavg: the local SGD learning rate
    lr: float = Field(default=0.1, gt=0, json_schema_extra={"allowed": "finite, > 0"})
    #: fedavg: the local SGD momentum
    momentum: float = Field(default=0.0, ge=0, lt=1, json_schema_extra={"allowed": "[0, 1)"})
    #: fedavg: the local SGD weight decay
    weight_decay: float = Field(default=0.0, ge=0, json_schema_extra={"allowed": "finite, >= 0"})
    #: train the model in train mode (BatchNorm on batch statistics) as deployed clients do; false reproduces eval-
    #: mode papers
    train_mode: bool = True
    #: the client inspects every model it receives (``guardfl.inspect_model`` with the honest global model
    #: as the reference and its first batch, as ``local_update(inspect=True)`` does) and refuses one that
    #: is not ok: a malicious server's refused model gets nothing. Only what a malicious-server attack
    #: sends is inspected (an honest server's model is the honest one)
    inspect: bool = False
    #: with ``inspect``: the inspection adds SEER's D-SNR check (``inspect_model(..., disaggregation=True)``,
    #: Garov et al. 2024: the model in train mode on the client's first batch, per-sample weight-gradient
    #: norms, refused above ``DSNR_THRESHOLD`` = 2 on batches of 8 or more), as
    #: ``local_update(..., inspect=True, inspect_disaggregation=True)`` runs it
    inspect_disaggregation: bool = False
    #: with ``inspect``: the client refuses any model, the honest global model included, with which a
    #: server reads more than this many samples of its first batch from the update's linear layers
    #: (``inspect_model(..., leak_limit=)``, as ``local_update(..., inspect_leak_limit=)`` runs it). A
    #: refused honest model is nothing sent: the honest-server attacks read nothing from that batch, and
    #: the certificate says the client trained nothing there
    inspect_leak_limit: int | None = Field(default=None, ge=0, le=4096,
                                           json_schema_extra={"allowed": "null or an integer in [0, 4096]"})
    #: with ``inspect_leak_limit``: the client keeps what it sent between rounds (``local_update`` with its
    #: ``ClientState``: a ``LeakHistory``), and the limit is on what one update, its difference with any
    #: earlier update of the same batch, and earlier rounds read together (a malicious server's queries are
    #: the client's rounds). false: a client built anew each round (a Flower ``client_fn``, NVIDIA FLARE),
    #: whose limit holds per update only (``threshold_bins`` reads faces exactly through it by differencing).
    #: ``{max_rounds: n, max_batches: m}``: kept, with the deployed client's limits (``inspect_leak_history``
    #: of the integrations; a batch answered ``max_rounds`` times is refused; defaults 256 and 64)
    inspect_leak_history: bool | LeakHistoryLimits = True
    #: the client's round budget (``local_update(..., max_rounds=)``, ``flower.RoundBudgetMod``): it answers
    #: at most this many rounds, whatever model arrives. A malicious server's queries are its rounds: one past
    #: the budget is refused (nothing sent), and ``repeats: auto`` averages every round of it against a
    #: fresh-noise defense, so the verdict holds for a client that keeps this budget. null: none (the
    #: attacks' ``repeats: auto`` then sends 16 rounds, and the verdict covers no more)
    max_rounds: int | None = Field(default=None, ge=1, le=MAX_ROUNDS_LIMIT,
                                   json_schema_extra={"allowed": f"null or an integer in [1, {MAX_ROUNDS_LIMIT}]"})
    #: the client's local dataset size, for DP-SGD accounting (sample rate = batch_size / dataset_size)
    dataset_size: int | None = Field(default=None, ge=1, json_schema_extra={"allowed": "null or an integer >= 1"})

    @field_validator("inspect_leak_history", mode="before")
    @classmethod
    def _leak_history_spec(cls, value: Any) -> Any:
        """One error for the field, not one per branch of ``bool | LeakHistoryLimits``."""
        if isinstance(value, (bool, LeakHistoryLimits)):
            return value
        if isinstance(value, dict):
            try:
                return LeakHistoryLimits.model_validate(value)
            except ValidationError as err:
                first = err.errors()[0]
                where = ".".join(map(str, first["loc"]))
                raise PydanticCustomError("leak_history_limits", "{where}: {msg}; allowed: max_rounds and max_batches, integers "
                                          "in [1, 100000]", {"where": where, "msg": first["msg"]}) from None
        raise PydanticCustomError("leak_history_spec", "must be true, false or a mapping of max_rounds and max_batches "
                                  "(integers in [1, 100000])")

    def leak_history_spec(self) -> bool | dict[str, int]:
        """``inspect_leak_history`` as the simulated client takes it: a flag, or the limits as a dict."""
        h = self.inspect_leak_history
        return h if isinstance(h, bool) else h.model_dump()

    @model_validator(mode="after")
    def _disaggregation_inspects(self) -> "ClientSection":
        if self.inspect_disaggregation and not self.inspect:
            raise ValueError("inspect_disaggregation: true adds a check to the client's inspection, but inspect is false: "
                             "set inspect: true, or remove inspect_disaggregation")
        if self.inspect_leak_limit is not None and not self.inspect:
            raise ValueError("inspect_leak_limit: a limit adds a check to the client's inspection, but inspect is false: "
                             "set inspect: true, or remove inspect_leak_limit")
        if not self.inspect_leak_history and self.inspect_leak_limit is None:
            raise ValueError("inspect_leak_history: false says how the client keeps its leak limit, but inspect_leak_limit is "
                             "not set: set inspect_leak_limit, or remove inspect_leak_history")
        return self

    @model_validator(mode="after")
    def _fedavg_fields(self) -> "ClientSection":
        """A FedSGD client sends one gradient: the local-training fields are FedAvg's and refused when set
        (to other than their defaults) for it, not silently ignored."""
        if self.protocol == "fedsgd":
            for name in ("epochs", "samples", "lr", "momentum", "weight_decay"):
                value = getattr(self, name)
                if value != type(self).model_fields[name].default:
                    raise ValueError(f"{name}: {value!r} is a FedAvg setting (local training), but protocol is 'fedsgd' "
                                     "(one gradient, which never reads it): remove it, or set protocol: fedavg")
        return self

    @property
    def n(self) -> int:
        """Samples per client (one FedSGD batch, or the FedAvg local dataset)."""
        return self.batch_size if self.protocol == "fedsgd" else (self.samples or self.batch_size)


class AttackSection(StrictModel):
    #: a registered attack (see the Attacks reference)
    name: str
    #: the attack's own keys (iterations, restarts, ...): its Config on the Attacks reference; unset keys take the
    #: strength's budget
    budget: dict[str, Any] = Field(default_factory=dict)
    #: the threat's settings (``ThreatModel.as_config``); the attacker's auxiliary data is the config's ``aux``
    #: section, added by the run (``ThreatModel.with_aux``), never a threat key
    threat: ThreatModel = Field(default_factory=ThreatModel)

    @field_validator("threat", mode="wrap")
    @classmethod
    def _threat_settings(cls, value: Any, handler: Any) -> ThreatModel:
        """A threat section as the config's: a mapping of the settings, ``aux`` refused as an unknown key."""
        if isinstance(value, ThreatModel):
            if value.aux is not None:
                raise ValueError("aux: the attacker's auxiliary data is the config's aux section, not a threat setting")
            return handler(value)
        if not isinstance(value, dict):  # the words configs have always been refused with
            raise PydanticCustomError("model_type", "Input should be a valid dictionary or instance of ThreatSection")
        if "aux" not in value:
            return handler(value)
        marker = "\0aux"  # refused by the model as an unknown key, in its place among the others, then renamed
        try:
            handler({marker if k == "aux" else k: v for k, v in value.items()})
        except ValidationError as err:
            raise ValidationError.from_exception_data(err.title, [
                {"type": e["type"], "loc": tuple("aux" if x == marker else x for x in e["loc"]), "input": e["input"],
                 **({"ctx": e["ctx"]} if "ctx" in e else {})} for e in err.errors(include_url=False)]) from None
        raise AssertionError("unreachable: a ThreatModel refuses an unknown key")

    @field_validator("name")
    @classmethod
    def _known(cls, name: str) -> str:
        from guardfl.redteam.attacks import available

        if name not in available():
            raise ValueError(f"unknown attack {name!r}; allowed: {', '.join(available())}")
        return name

    @model_validator(mode="after")
    def _budget(self) -> "AttackSection":
        from guardfl.redteam.attacks import get

        get(self.name, **self.budget)  # raises ConfigError naming the field
        return self


class TargetSection(StrictModel):
    """The user's own client code, certified instead of a described client (see ``guardfl.redteam.client.target``)."""

    #: your Flower ClientApp, sent the global model as a FedAvg ServerApp would; its reply is attacked
    clientapp: str | None = Field(default=None, json_schema_extra={"allowed": "null or 'module:attr' of a flwr ClientApp"})
    #: your training function, called as train_fn(model, loader) -> model
    train_fn: str | None = Field(default=None, json_schema_extra={"allowed": "null or 'module:callable' (model, loader) -> model"})
    #: an NVFlare Client API site's training round: ``module:callable`` called as
    #: ``fn(input_model: FLModel, site="site-<b+1>", **run_config) -> FLModel`` (it loads its own data)
    nvflare: str | None = Field(default=None, json_schema_extra={"allowed": "null or 'module:callable' (FLModel, site=...) -> FLModel"})
    #: NVFlare only: the exported job whose sites' ``train`` result filters are applied to the result, as
    #: the site applies them (a folder with one config_fed_client.json, or that file)
    job: str | None = None
    #: NVFlare only: result filters given here instead of a job (``[{path: module.Class, args: {...}}]``)
    result_filters: list[dict[str, Any]] | None = None
    #: folder put on sys.path (and, for a ClientApp, whose pyproject.toml gives the run config)
    app_dir: str | None = None
    #: the ConfigRecord sent with the global model (what the ServerApp's train_config holds)
    config: dict[str, Any] = Field(default_factory=dict)
    #: run-config overrides (on top of app_dir/pyproject.toml's [tool.flwr.app.config])
    run_config: dict[str, Any] = Field(default_factory=dict)
    #: the node config of the client; batch b also gets ``partition_key: b`` (Flower's partition-id convention)
    node_config: dict[str, Any] = Field(default_factory=dict)
    #: the node-config key that carries the update's index b (Flower's partition-id)
    partition_key: str | None = "partition-id"

    @model_validator(mode="after")
    def _exactly_one(self) -> "TargetSection":
        if sum(ref is not None for ref in (self.clientapp, self.train_fn, self.nvflare)) != 1:
            raise ValueError("give exactly one of clientapp ('module:app'), train_fn ('module:callable') or nvflare "
                             "('module:callable', an NVFlare Client API train round)")
        if self.nvflare is None and (self.job is not None or self.result_filters is not None):
            raise ValueError("job / result_filters: NVFlare's result filters apply to a target.nvflare only")
        if self.job is not None and self.result_filters is not None:
            raise ValueError("give at most one of job (an exported NVFlare job) or result_filters")
        from guardfl.redteam.runtime.userref import UserCodeError, split_ref

        for name in ("clientapp", "train_fn", "nvflare"):
            ref = getattr(self, name)
            if ref is not None:
                try:
                    split_ref(ref, name)
                except UserCodeError as err:
                    raise ValueError(str(err)) from None
        return self


class CertifySection(StrictModel):
    #: images: a sample leaks when a reconstruction's SSIM reaches this (and beats the prior by prior_margin)
    max_ssim: float | None = Field(default=0.4, ge=-1, le=1, json_schema_extra={"allowed": "null or [-1, 1]"})
    #: images: a sample leaks when a reconstruction's PSNR reaches this many dB
    max_psnr: float | None = Field(default=None, gt=0, json_schema_extra={"allowed": "null or finite, > 0 (dB)"})
    #: images: a sample leaks when a reconstruction's LPIPS distance falls to this (needs AlexNet's weights:
    #: lpips_weights)
    min_lpips: float | None = Field(default=None, ge=0, json_schema_extra={"allowed": "null or finite, >= 0"})
    #: the largest share of labels an attack may restore (a worst case over updates, not a rate claim)
    max_label_acc: float | None = Field(default=None, ge=0, le=1, json_schema_extra={"allowed": "null or [0, 1]"})
    #: text thresholds (a text model's certificate; the image ones apply to images only): ROUGE-1 / ROUGE-2
    #: F-measure and the share of positions reconstructed exactly, per private sample
    max_rouge1: float | None = Field(default=0.5, ge=0, le=1, json_schema_extra={"allowed": "null or [0, 1]"})
    #: text: a sample leaks when a reconstruction's ROUGE-2 F-measure reaches this
    max_rouge2: float | None = Field(default=None, ge=0, le=1, json_schema_extra={"allowed": "null or [0, 1]"})
    #: text: a sample leaks when this share of its positions is reconstructed exactly
    max_token_acc: float | None = Field(default=0.5, ge=0, le=1, json_schema_extra={"allowed": "null or [0, 1]"})
    #: the budget of the sequential rule (``certification.sequential``): updates are attacked round after round
    #: until every claim is decided at ``confidence``, or until one of these runs out (then INCONCLUSIVE).
    #: ``max_updates``: client updates attacked at most (each with ``client.n`` private samples); null: twice
    #: the fewest leak-free updates that certify the strictest claim (76 for 10% at 95%), or ``max_samples``'
    #: count. ``max_samples``: the same budget in private samples (``ceil(max_samples / client.n)`` updates;
    #: the smaller of the two when both are set). ``max_seconds``: no new round starts after this long (a
    #: budget that depends on the machine: the certificate says when it stopped a run). None of them enters
    #: the config's hash: ``--resume`` can give a run more.
    max_updates: int | None = Field(default=None, ge=1, le=100_000,
                                    json_schema_extra={"allowed": "null or an integer in [1, 100000]"})
    #: the budget in private samples (ceil(max_samples / client.n) updates; the smaller budget wins)
    max_samples: int | None = Field(default=None, ge=1, le=10_000_000,
                                    json_schema_extra={"allowed": "null or an integer in [1, 10000000]"})
    #: no new round starts after this many seconds (INCONCLUSIVE then, with how many more updates would decide)
    max_seconds: float | None = Field(default=None, gt=0, le=30 * 24 * 3600,
                                      json_schema_extra={"allowed": "null or finite, in (0, 2592000] (seconds)"})
    #: the population claim: the deployment's leak rate (the mean share of an update's private samples that
    #: some attack reconstructs past a threshold) is below ``max_leak_rate``; null: no such claim
    max_leak_rate: float | None = Field(default=0.05, gt=0, lt=1, json_schema_extra={"allowed": "null or a rate in (0, 1)"})
    #: the re-identification claim: the mean share of an update's private samples the attacker names
    #: correctly among ``reid`` candidates (``certification.reid``) is below ``max_reid_rate``; null: no claim
    max_reid_rate: float | None = Field(default=None, gt=0, lt=1, json_schema_extra={"allowed": "null or a rate in (0, 1)"})
    #: the confidence of every claim's decision (the anytime-valid rule's 1 - alpha)
    confidence: float = Field(default=0.95, ge=0.5, lt=1, json_schema_extra={"allowed": "a probability in [0.5, 1)"})
    #: a file with AlexNet's ImageNet weights for LPIPS (else the torch hub cache; without them LPIPS is reported
    #: unavailable)
    lpips_weights: str | None = None
    #: with auxiliary data the attacker's prior guess (the mean auxiliary image, no update used) can
    #: already resemble a private image (aligned faces: SSIM ~0.5); a reconstruction then counts against
    #: max_ssim / max_psnr only if it also beats that prior on the image by more than this margin.
    #: null: absolute thresholds only.
    prior_margin: float | None = Field(default=0.05, ge=0, json_schema_extra={"allowed": "null or finite, >= 0"})
    #: the proven bound's prior baseline (``guardfl.bounds``): the probability that the attacker's best guess
    #: without the client's updates already meets the success criterion (1/n for a known candidate set of n).
    #: null: estimated from the auxiliary data against the private samples with this certificate's criterion
    #: and a one-sided ``confidence`` upper bound (no auxiliary data: no bound)
    kappa: float | None = Field(default=None, gt=0, lt=1, json_schema_extra={"allowed": "null (estimated) or a probability in (0, 1)"})

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, value: Any) -> Any:
        if isinstance(value, dict) and "batches" in value:
            raise ValueError("batches: renamed max_updates (the most client updates attacked: the sequential rule "
                             "stops earlier once the verdict is decided); allowed: max_updates: null or an integer in "
                             "[1, 100000]")
        return value

    @model_validator(mode="after")
    def _a_claim(self) -> "CertifySection":
        if self.max_leak_rate is None and self.max_reid_rate is None:
            raise ValueError("max_leak_rate / max_reid_rate: give at least one claim (a rate in (0, 1))")
        return self

    @model_validator(mode="after")
    def _some_threshold(self) -> "CertifySection":
        if all(v is None for v in (self.max_ssim, self.max_psnr, self.min_lpips, self.max_label_acc, self.max_rouge1,
                                   self.max_rouge2, self.max_token_acc)):
            raise ValueError("set at least one threshold (max_ssim, max_psnr, min_lpips, max_label_acc, max_rouge1, "
                             "max_rouge2, max_token_acc)")
        return self
