"""``trap_weights``' budget: its typed configuration, each option with its allowed range (the module docstring of
``trap_weights`` says what each construction adapts to)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from guardfl.redteam.attacks.base import AttackConfig
from guardfl.redteam.attacks.malicious.server import Denoise, Repeats


class TrapWeightsConfig(AttackConfig):
    chains: int = Field(default=2, ge=1, le=64, json_schema_extra={"allowed": "an integer in [1, 64]"})
    #: relative noise on each row's share of its chain's classifier column; "auto": against an inspecting
    #: client the least that passes its shared-columns check on the attacker's auxiliary data
    #: (``evade_columns.least_passing``), else 0
    column_noise: Literal["auto"] | float = Field(default="auto", json_schema_extra={"allowed": "'auto' or a number in [0, 1]"})
    #: rows per chain, cut at the top of the measurement (one sample per bin on average), the rest of the
    #: layer left honest: a small trap that reads a few samples and stays under a check that counts
    #: isolated samples against the honest model's; null: the whole layer; "auto": ``trap_size.AUTO_ROWS``,
    #: or fewer so that every chain's rows survive a known pruning whole (``trap_size.auto_rows``); "fit":
    #: the size (chains and rows, ``trap_fit.FIT_SIZES`` and the whole layer) that reads most of a shadow
    #: client's batch of auxiliary images, the client's inspection and defense included (``trap_fit``;
    #: ``chains`` is then only the whole layer's)
    rows: Literal["auto", "fit"] | int | None = Field(default=None, json_schema_extra={"allowed": "null (the whole layer), 'auto', 'fit' or an integer in [1, 65536]"})
    #: the trapped rows' classifier columns at this many times the honest columns' mean norm: their
    #: gradients as many times larger, so that a defense that keeps the largest entries of a layer
    #: (GradPrune, Outpost's pruning) keeps theirs, and noise of a fixed scale is small beside them;
    #: "auto": ``TRAP_BOOST`` against a known pruning or noise defense (``boost_for``), else 1
    boost: Literal["auto"] | float = Field(default="auto", json_schema_extra={"allowed": "'auto' or a number in [1, 1e6]"})
    #: where the ``rows`` cut the measurement: "top" (one sample per bin on average, the top row one sample
    #: too) or "middle" (around the median: every sample above the lowest cut, about half the batch, sends
    #: the boosted gradient, so that no one sample dominates the layer: adapted to the D-SNR check)
    cuts: Literal["top", "middle"] = Field(default="top", json_schema_extra={"allowed": "'top' or 'middle' (with rows)"})
    #: the rows' scales within a chain: "random" (each in [0.5, 2]), "equal" (one scale, each row with a tiny
    #: random part; through BatchNorm one BatchNorm weight per chain): adapted to FedAvg, where a chain's
    #: classifier columns would otherwise drift apart over the local steps, in proportion to the rows'
    #: different activations, and the adjacent differences would no longer cancel; "auto": equal against a
    #: FedAvg client, else random. Through GroupNorm "equal" also undoes the normalisation's scale (the
    #: FedAvg delta keeps the bins' digits); through LayerNorm a chain always shares one scale
    scales: Literal["auto", "random", "equal"] = Field(default="auto", json_schema_extra={"allowed": "'auto', 'random' or 'equal'"})
    #: each row with a near-multiple in the layer gets a part images barely see, this many times its norm
    #: (``trap_chain.disguise``): adapted to the near-parallel-rows check; "auto": ``trap_chain.auto_rho()``
    #: (two rows of a chain at |cos| ~0.98, under the check's 0.99) for a small trap (``rows``), else 0
    disguise: Literal["auto"] | float = Field(default="auto", json_schema_extra={"allowed": "'auto' or a number in [0, 4]"})
    #: rows per cut, each with its own classifier column (a random combination of the chain's ``columns``
    #: random basis columns; ``trap_groups``): no two rows share a column or have proportional coefficients,
    #: and the server solves each cut's ``columns x columns`` system (adapted to the shared-columns check
    #: and the pairwise isolation tests); 1: ``trap_weights``' one column per chain. With ``rows``, that many
    #: cuts per chain (the top cut one row). Without a normalisation only; random scales under FedAvg too
    #: (``scales`` does not apply)
    columns: int = Field(default=1, ge=1, le=16, json_schema_extra={"allowed": "an integer in [1, 16]"})
    #: the trap sent this many times and the updates averaged (``server.query_averaged``): fresh noise per
    #: round shrinks by the square root; "auto": ``server.AUTO_REPEATS`` against a known defense that draws
    #: fresh noise (``server.FRESH_NOISE``), else 1
    repeats: Repeats = "auto"
    denoise: Denoise = "auto"  # the filter of its reads (``server.Denoise``)
    min_mass: float = Field(default=1e-6, ge=0, lt=1, json_schema_extra={"allowed": "in [0, 1)"})
    #: after the bins, read the samples the sent model's first-layer units hold alone, checked against that
    #: model and peeled (``exclusive_neurons.read_checked``; FedSGD, no normalisation before the ReLU)
    peel: bool = True

    @field_validator("rows", mode="before")
    @classmethod
    def _rows(cls, value):
        if value not in (None, "auto", "fit") and not (isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 65536):
            raise ValueError(f"expected null, 'auto', 'fit' or an integer in [1, 65536] (got {value!r})")
        return value

    @field_validator("boost", "disguise", "column_noise", mode="before")
    @classmethod
    def _auto_or_number(cls, value, info):
        low, high = {"boost": (1, 1e6), "disguise": (0, 4), "column_noise": (0, 1)}[info.field_name]
        if value != "auto" and not (isinstance(value, (int, float)) and not isinstance(value, bool) and low <= value <= high):
            raise ValueError(f"expected 'auto' or a number in [{low:g}, {high:g}] (got {value!r})")
        return value

    @model_validator(mode="after")
    def _cuts_need_rows(self) -> "TrapWeightsConfig":
        if self.cuts != "top" and self.rows is None:
            raise ValueError(f"cuts: {self.cuts!r} places a small trap's rows, but rows is null (the whole layer is cut at "
                             "quantiles): set rows, or remove cuts")
        return self


#: relative column noise levels ``column_noise: auto`` tries in turn against an inspecting client
COLUMN_NOISE_LEVELS = (0.01, 0.02, 0.03, 0.05, 0.07, 0.1, 0.15, 0.2, 0.3, 0.5)
