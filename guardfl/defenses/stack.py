"""A stack of defenses applied in order (for example GradPrune then GaussianNoise).

``identity`` is refused as a member: it does nothing in a stack, and a stack of nothing but identities
(``Stack(Identity(), Identity())``) would be accepted and send the gradient as it is. The deliberate
undefended baseline is ``Identity()`` alone. A zero-strength member is refused by its own config, and the
message names its position.

The members are the instances given, not copies rebuilt from their configs: a user subclass (one that
overrides ``_apply_``, say) keeps its behaviour inside a stack, and its config is the one the stack reports
and serialises. A stack built from a config (a dict, YAML) builds its members from their configs. A member
without its own ``seed`` is reseeded from the stack's seed (reproducible when the stack is seeded), which
changes the random stream of that instance.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, SerializeAsAny, field_validator
from torch import Tensor

from guardfl.config import validate
from guardfl.defenses.base import REGISTRY, Defense, DefenseConfig, StepContext, register
from guardfl.defenses.strength import BASELINE_HINT
from guardfl.errors import ConfigError
from guardfl.stats import StageStats


class StackConfig(DefenseConfig):
    kind: Literal["stack"] = "stack"
    defenses: list[SerializeAsAny[DefenseConfig]] = Field(
        min_length=1, json_schema_extra={"allowed": "a non-empty list of defense configs"}
    )

    @field_validator("defenses", mode="before")
    @classmethod
    def _parse_members(cls, value: Any) -> Any:
        from guardfl.defenses.registry import parse_config

        if not isinstance(value, (list, tuple)):
            return value
        parsed = []
        for i, item in enumerate(value):
            try:
                parsed.append(parse_config(item.config if isinstance(item, Defense) else item))
            except ConfigError as err:
                raise ValueError(f"[{i}] {err}") from None
            if parsed[-1].kind == "identity":
                raise ValueError(f"[{i}] identity changes nothing in a stack; allowed: members other than identity; "
                                 f"{BASELINE_HINT} alone")
        return parsed

    def leaves(self) -> list[DefenseConfig]:
        return [leaf for member in self.defenses for leaf in member.leaves()]

    def map_leaves(self, fn) -> "StackConfig":
        return self.model_copy(update={"defenses": [member.map_leaves(fn) for member in self.defenses]})


@register
class Stack(Defense):
    """Apply ``defenses`` in order. Members without their own ``seed`` get one derived from the
    stack's seed (or from OS entropy), so a seeded stack reproduces and an unseeded one does not.

    Args:
        defenses: the defenses (objects, configs or dicts) applied in order.
        seed: an integer in [0, 2**32 - 1] for a reproducible stream; ``None`` (the default, as deployed): OS
            entropy.
        nonfinite: ``"raise"`` (default): a NaN or inf in the gradient raises; ``"zero"``: such entries are
            zeroed.
    """

    Config = StackConfig

    def __init__(self, *defenses: Defense | DefenseConfig | dict, seed: int | None = None, nonfinite: str = "raise") -> None:
        # The given instances become the members (set before validation: _init_from_config reads them).
        self._given: list[Defense | None] = [d if isinstance(d, Defense) else None for d in defenses]
        super().__init__(defenses=list(defenses), seed=seed, nonfinite=nonfinite)

    @classmethod
    def regroup(cls, members: list[Defense]) -> "Stack":
        """A stack of existing defenses that keeps their seeds and random streams as they are (not
        reseeded): ``guardfl.protect`` regroups the gradient-stage leaves of a larger stack with it."""
        self = cls.__new__(cls)
        self._given, self._keep_member_seeds = list(members), True
        self._init_from_config(validate(cls.Config, {"kind": "stack", "defenses": list(members)}, prefix="stack"))
        return self

    def _init_from_config(self, config: DefenseConfig) -> None:
        super()._init_from_config(config)
        given = self.__dict__.pop("_given", None) or [None] * len(config.defenses)
        self.members = [d if d is not None else REGISTRY[c.kind].from_config(c) for d, c in zip(given, config.defenses)]
        if not self.__dict__.pop("_keep_member_seeds", False):
            self._seed_members()

    def _seed_members(self) -> None:
        for i, member in enumerate(self.members):
            if member.config.seed is None:  # a seeded stack derives its members' seeds; else OS entropy each
                member.reseed(None if self.stream_seed is None else (self.stream_seed * 1_000_003 + 7919 * (i + 1)) % (1 << 63))

    def fresh(self) -> "Stack":
        new = type(self).__new__(type(self))
        new._given = [m.fresh() for m in self.members]  # then reseeded from the stack's seed, as from_config does
        new._init_from_config(self.config.model_copy(deep=True))
        return new

    def reseed(self, seed: int | None) -> None:
        super().reseed(seed)
        self._seed_members()

    def leaves(self) -> list[Defense]:
        return [leaf for member in self.members for leaf in member.leaves()]

    @property
    def needs_params(self) -> bool:  # type: ignore[override]
        return any(m.needs_params for m in self.members)

    @property
    def needs_model(self) -> bool:  # type: ignore[override]
        return any(m.needs_model for m in self.members)

    def check_model(self, model) -> None:
        for member in self.members:
            member.check_model(model)

    @property
    def randomized(self) -> bool:  # type: ignore[override]
        return any(m.randomized for m in self.members)

    def apply_(self, grads, ctx: StepContext | None = None) -> tuple[StageStats, ...]:
        ctx = ctx if ctx is not None else StepContext()
        if not ctx.known_finite(grads):
            self._handle_nonfinite(grads, ctx)
            ctx.mark_finite(grads)
        stages: list[StageStats] = []
        for member in self.members:
            stages.extend(member.apply_(grads, ctx))
            if type(member).apply_ not in (Defense.apply_, Stack.apply_):
                ctx.checked = ()  # a member's own apply_ may edit past the record (through .data): check again
        return tuple(stages)

    def apply_batch_(self, grads, *, iteration: int = 1, params=None, names=None, batched_params: bool = False) -> None:
        """Each member in order on all N clients (rows are independent, so this is each client's stack)."""
        self._handle_nonfinite(grads, StepContext(iteration=iteration, params=params, names=names))
        for member in self.members:
            member.apply_batch_(grads, iteration=iteration, params=params, names=names, batched_params=batched_params)

    def _apply_(self, grads: list[Tensor], ctx: StepContext) -> StageStats:  # pragma: no cover
        raise AssertionError("Stack.apply_ dispatches to its members")
