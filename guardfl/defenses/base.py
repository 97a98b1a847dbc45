"""The small interface every gradient defense implements, its config base and its registry.

A defense transforms the list of gradients of one optimizer step. The maths lives in pure functions
(``guardfl.ops``); a defense class holds its validated config and a private random generator.

Randomness: each defense owns ``torch.Generator`` objects (one per device) seeded from OS entropy
unless ``seed`` is given. The global RNG is never read or reseeded. A config's ``seed`` is an integer in
[0, 2**32 - 1]: torch's CPU generator (mt19937) keeps only the low 32 bits of a seed, so a larger seed would
silently repeat the stream of a smaller one (2**64 gave the stream of 0) and is refused.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Literal, Sequence

import torch
from pydantic import Field
from torch import Tensor, nn

from guardfl.config import StrictModel, validate
from guardfl.errors import ConfigError, NonFiniteGradientError
from guardfl.ops.finite import nonfinite_counts, nonfinite_where
from guardfl.ops.scratch import Scratch
from guardfl.stats import StageStats, StepStats

NonFinitePolicy = Literal["raise", "zero"]

#: The largest ``seed`` a config accepts: every seed in [0, SEED_MAX] gives its own stream on every device.
SEED_MAX = 2**32 - 1
#: The largest seed ``reseed`` accepts (derived seeds: per round, per stack member; 63 bits, as the stream
#: derivations below reduce seeds modulo 2**63).
RESEED_MAX = 2**63 - 1


class DefenseConfig(StrictModel):
    """Fields every defense config has. Subclasses add their parameters and a ``kind`` literal."""

    #: selects the defense (its table on this page)
    kind: str
    #: the defense's random stream: an integer reproduces it, null (as deployed) draws it from OS entropy.
    #: torch's CPU generator (mt19937) keeps only the low 32 bits of a seed: 2**32 and 0 would give one
    #: stream, so a seed beyond 32 bits is refused rather than silently aliased.
    seed: int | None = Field(
        default=None, ge=0, le=SEED_MAX, json_schema_extra={"allowed": "null (OS entropy) or an integer in [0, 2**32 - 1]"}
    )
    nonfinite: NonFinitePolicy = Field(default="raise", json_schema_extra={"allowed": "'raise' or 'zero'"})

    def leaves(self) -> list["DefenseConfig"]:
        """The configs of the defenses this one applies, in order: itself, or a stack's members expanded
        at every depth (``StackConfig`` overrides this: the one walk over a stack's configs)."""
        return [self]

    def map_leaves(self, fn: Callable[["DefenseConfig"], "DefenseConfig"]) -> "DefenseConfig":
        """This config with each leaf (``leaves``) replaced by ``fn(leaf)``, the structure kept: itself
        mapped, or a stack with its members mapped (``StackConfig`` overrides this)."""
        return fn(self)


@dataclass
class StepContext:
    """What a defense may know about the step besides the gradients.

    ``iteration``: 1-based local iteration within the current FL round. ``params``: the parameters the
    gradients belong to (current weights, before the update), same order. ``names``: their names.
    ``model``: the client's model and ``inputs``: the inputs of its latest forward pass (detached), for the
    defenses that need them (``Defense.needs_model``: Soteria, GradDefense). No labels: ``GuardedOptimizer``
    sees the model's inputs, not the loss.
    """

    iteration: int = 1
    params: Sequence[Tensor] | None = None
    names: Sequence[str] | None = None
    model: nn.Module | None = None
    inputs: Tensor | None = None
    #: The gradients ``apply_`` last found (or made sure) finite, each with its version counter: the next
    #: stage of a stack skips checking its input again while they are the same tensors at the same
    #: versions. An in-place edit bumps a tensor's version (a subclass's own ``apply_``, a caller reusing
    #: the context for the next step's gradients), so the next stage checks again; an edit through
    #: ``.data`` (a version counter of its own) is not seen here, but ``GuardedOptimizer`` checks the
    #: final gradients whatever this records.
    checked: tuple = field(default=(), repr=False, compare=False)
    #: The output tensors the defense proved finite by a full reduction over them after its last write, with
    #: their version counters (``verify_output``): ``GuardedOptimizer`` trusts this only from a defense whose
    #: own class declares ``verifies_output`` (no subclass or stack code runs after the reduction)
    verified: tuple = field(default=(), repr=False, compare=False)

    def name(self, i: int) -> str:
        return self.names[i] if self.names is not None else f"param{i}"

    def mark_finite(self, grads: Sequence[Tensor]) -> None:
        """Record that ``grads`` hold no NaN or inf as they are now."""
        self.checked = tuple((g, _version(g)) for g in grads)

    def verify_output(self, grads: Sequence[Tensor]) -> None:
        """Record that ``grads`` were proved finite after the defense's last write to them."""
        self.verified = tuple((g, _version(g)) for g in grads)

    def output_verified(self, g: Tensor) -> bool:
        """Whether ``g`` is one of the recorded verified outputs, unchanged since (same version)."""
        return any(g is t and v is not None and _version(g) == v for t, v in self.verified)

    def known_finite(self, grads: Sequence[Tensor]) -> bool:
        """Whether ``grads`` are the tensors ``mark_finite`` recorded, unchanged since."""
        return len(grads) == len(self.checked) and all(
            g is t and v is not None and _version(g) == v for g, (t, v) in zip(grads, self.checked))


def _version(t: Tensor) -> int | None:
    """A tensor's in-place version counter (None where it has none: inference-mode tensors)."""
    try:
        return t._version
    except RuntimeError:
        return None


#: kind -> defense class; filled by ``@register``.
REGISTRY: dict[str, type["Defense"]] = {}


def register(cls: type["Defense"]) -> type["Defense"]:
    """Class decorator: make a defense buildable by ``from_config`` under its config's ``kind``."""
    kind = cls.Config.model_fields["kind"].default
    if kind in REGISTRY and REGISTRY[kind] is not cls:
        raise ValueError(f"defense kind {kind!r} registered twice")
    cls.kind = kind
    REGISTRY[kind] = cls
    return cls


def os_entropy_seed() -> int:
    """A 63-bit seed from the operating system's entropy pool."""
    return int.from_bytes(os.urandom(8), "little") >> 1


#: torch's CPU generator state (``get_state``): 8 bytes initial seed, 2 x int32 (left, seeded), 8 bytes
#: next, then mt19937's 624 state words, each in 8 bytes
_MT_WORDS, _MT_OFFSET = 624, 24


def _mt_layout_ok() -> bool:
    gen = torch.Generator().manual_seed(1)
    words = torch.frombuffer(bytearray(gen.get_state().numpy().tobytes()), dtype=torch.int64)
    return int(words[3]) == 1 and int(words[4]) == 1812433254 and int(words[1]) == (1 << 32) + 1


def make_generator(device: torch.device | str, seed: int | None, offset: int = 0) -> torch.Generator:
    """A generator for ``device``: from ``seed`` (reproducible; ``offset`` derives another stream), or
    with ``seed=None`` from OS entropy. Seeding alone is not enough there: torch's CPU generator (mt19937)
    keeps only 32 bits of a seed, so 2**32 candidate streams, few enough for an attacker to try them all
    against a noised update. Its whole 19,968-bit state is filled from the OS pool instead (CUDA's Philox
    takes the full 64-bit seed)."""
    gen = torch.Generator(device=device)
    if seed is not None:
        return gen.manual_seed((seed + 0x9E3779B97F4A7C15 * offset) % (1 << 63))
    gen.manual_seed(os_entropy_seed())
    if gen.device.type == "cpu":
        if not _mt_layout_ok():  # a future torch with another state layout: refuse rather than weaken
            raise RuntimeError("guardfl: torch's CPU generator state layout changed; cannot seed it from OS entropy")
        raw = bytearray(gen.get_state().numpy().tobytes())
        words = torch.frombuffer(bytearray(os.urandom(4 * _MT_WORDS)), dtype=torch.int32).to(torch.int64) & 0xFFFFFFFF
        raw[_MT_OFFSET : _MT_OFFSET + 8 * _MT_WORDS] = words.numpy().astype("<u8").tobytes()
        raw[8:16] = ((1 << 32) + 1).to_bytes(8, "little")  # left = 1, seeded: the next draw twists the new state
        gen.set_state(torch.frombuffer(raw, dtype=torch.uint8).clone())
    return gen


class Defense:
    """Base class. Subclasses set ``Config`` and implement ``_apply_``.

    ``apply_(grads, ctx)`` edits the gradient tensors in place (that is what ``GuardedOptimizer`` does
    to ``p.grad``) and returns a ``StageStats``; ``__call__(grads, ...)`` is the functional form: it
    works on copies and never mutates the caller's tensors.
    """

    Config: ClassVar[type[DefenseConfig]]
    kind: ClassVar[str]
    #: Whether ``_apply_`` reads the current weights (``ctx.params``).
    needs_params: ClassVar[bool] = False
    #: Whether ``_apply_`` reads the model and the batch inputs (``ctx.model``, ``ctx.inputs``); then
    #: ``GuardedOptimizer`` needs ``model=`` (it records the inputs with a forward pre-hook).
    needs_model: ClassVar[bool] = False
    #: Where the defense acts: "gradient" (the optimizer step, ``guardfl.wrap``), "dp" (DP-SGD through
    #: Opacus) or "input" (an input encoding of the data loader); the last two need ``guardfl.protect``.
    stage: ClassVar[str] = "gradient"
    #: Whether the defense draws randomness (two applications to the same gradient can differ). The red
    #: team's learned attacks redraw randomised defenses; deterministic ones need one draw.
    randomized: ClassVar[bool] = False
    #: Whether ``_apply_`` maps finite gradients to finite gradients in every dtype (sign, pruning, the
    #: identity): then ``apply_`` skips checking its output. Noise can overflow a 16-bit dtype: False.
    keeps_finite: ClassVar[bool] = False
    #: Whether ``_apply_`` finds non-finite inputs itself (calling ``_handle_nonfinite`` for them): then
    #: ``apply_`` does not scan its input first (sign reads it from the pass it needs anyway), when the
    #: defense's own class declares it (a subclass, whose ``_apply_`` may not, is scanned)
    checks_input_itself: ClassVar[bool] = False
    #: Whether ``_apply_`` ends with a full reduction over the outputs it records in ``ctx.verify_output``,
    #: which proves them finite: ``GuardedOptimizer`` then skips its final check of those tensors, when the
    #: defense's own class declares it (a subclass, which may write after, does not inherit the trust)
    verifies_output: ClassVar[bool] = False

    def leaves(self) -> list["Defense"]:
        """The defenses this one applies, in the order it applies them: itself, or a stack's members
        expanded at every depth (``Stack`` overrides this). Every walk over a defense uses it."""
        return [self]

    @property
    def stages(self) -> set[str]:
        """The stages ("gradient", "dp", "input") its leaves act at."""
        return {leaf.stage for leaf in self.leaves()}

    def __init__(self, **params: Any) -> None:
        kind = self.Config.model_fields["kind"].default
        config = validate(self.Config, {"kind": kind, **params}, prefix=kind)
        self._init_from_config(config)

    def _init_from_config(self, config: DefenseConfig) -> None:
        self.config = config
        self._seed = config.seed if config.seed is not None else os_entropy_seed()
        self._entropy = config.seed is None  # streams from OS entropy (not reproducible), see make_generator
        self._generators: dict[torch.device, torch.Generator] = {}
        self._scratch: Scratch | None = None
        self._check_config()

    @property
    def scratch(self) -> Scratch:
        """This defense's reusable work buffers (``guardfl.ops.scratch``), created on first use."""
        if getattr(self, "_scratch", None) is None:
            self._scratch = Scratch()
        return self._scratch

    def _check_config(self) -> None:
        """Cross-field checks a subclass needs (raise ConfigError)."""

    def check_model(self, model: nn.Module) -> None:
        """Checks against the model a ``needs_model`` defense will see (raise ConfigError); called by
        ``GuardedOptimizer`` when it is built, so a bad layer name fails before training starts."""

    @classmethod
    def from_config(cls, config: DefenseConfig | dict) -> "Defense":
        if isinstance(config, dict):
            config = validate(cls.Config, {"kind": cls.Config.model_fields["kind"].default, **config}, cls.kind)
        self = cls.__new__(cls)
        self._init_from_config(config.model_copy(deep=True))
        return self

    def fresh(self) -> "Defense":
        """A new instance of this defense, as ``from_config(self.config)`` builds it (random streams from the
        configured seed, or fresh OS entropy), carrying what a configuration cannot hold (Inter-InstaHide's
        public tensor; a stack's members, each made fresh). ``round_defense`` builds every FL round's
        defense with it."""
        return type(self).from_config(self.config)

    # -- randomness -------------------------------------------------------------------------------
    #: the FL round ``guardfl.integrations.round_defense`` built this instance for (its seed, if any, is
    #: that round's); None for an instance built otherwise
    round_index: int | None = None

    def seeded_randomness(self) -> list[str]:
        """The kinds of this defense's randomised leaves whose streams come from an explicit seed (their own
        or a seeded stack's): the same noise again wherever the same seed is used again, which a server
        that differences two rounds' updates cancels. Empty for OS entropy or a deterministic defense."""
        return [leaf.kind for leaf in self.leaves() if leaf.randomized and leaf.stream_seed is not None]

    @property
    def stream_seed(self) -> int | None:
        """The seed this defense's random streams derive from (``make_generator``), None when they come
        from OS entropy: for a caller that derives streams of the defense's own (``guardfl.protect``: DP-SGD's
        noise and Poisson sampling; the red team's transmit simulator)."""
        return None if self._entropy else self._seed

    def generator(self, device: torch.device | str) -> torch.Generator:
        """This defense's private generator for ``device`` (created on first use)."""
        device = torch.device(device)
        gen = self._generators.get(device)
        if gen is None:
            # Different devices get different, reproducible streams from the one seed.
            offset = 0 if device.type == "cpu" else 1 + (device.index or 0)
            gen = make_generator(device, self.stream_seed, offset)
            self._generators[device] = gen
        return gen

    def reseed(self, seed: int | None) -> None:
        """Restart the random streams from ``seed`` (None: fresh OS entropy; else an integer in
        [0, 2**63 - 1], which the stream derivations use as it is)."""
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= RESEED_MAX):
            raise ConfigError(f"{self.kind}.reseed: seed must be null or an integer in [0, 2**63 - 1] (got {seed!r})")
        self._seed = seed if seed is not None else os_entropy_seed()
        self._entropy = seed is None
        self._generators.clear()

    # -- application ------------------------------------------------------------------------------
    def apply_(self, grads: Sequence[Tensor], ctx: StepContext | None = None) -> tuple[StageStats, ...]:
        """Defend ``grads`` in place; return what each stage did (one stage, or several for a Stack).
        Non-finite entries raise (or are zeroed, per ``nonfinite``)."""
        ctx = ctx if ctx is not None else StepContext()
        if self.needs_params:
            if ctx.params is None:
                raise ConfigError(f"{self.kind} needs the current weights: pass params= (or ctx.params)")
            if len(ctx.params) != len(grads):
                raise ValueError(f"{self.kind}: got {len(grads)} gradients but {len(ctx.params)} params")
        if self.needs_model and ctx.model is None:
            raise ConfigError(f"{self.kind} needs the model and the batch inputs: pass model= to guardfl.wrap / "
                              "GuardedOptimizer (functional form: model= and inputs=)")
        if self.needs_model and ctx.inputs is None:
            raise ConfigError(f"{self.kind} needs the batch inputs: none recorded (the model ran no forward pass "
                              "with grad enabled since the last step)")
        # ``checks_input_itself`` only from the class that declares it (a subclass's own ``_apply_`` may not)
        if not type(self).__dict__.get("checks_input_itself", False) and not ctx.known_finite(grads):
            self._handle_nonfinite(grads, ctx)
        with torch.no_grad():
            stats = self._apply_(list(grads), ctx)
        if not self.keeps_finite:
            self._check_output(grads, ctx)
        ctx.mark_finite(grads)
        return (stats,)

    def __call__(
        self,
        grads: Sequence[Tensor],
        params: Sequence[Tensor] | None = None,
        *,
        iteration: int = 1,
        names: Sequence[str] | None = None,
        model: nn.Module | None = None,
        inputs: Tensor | None = None,
    ) -> tuple[list[Tensor], StepStats]:
        """Functional form: defended copies of ``grads`` and what was done. Inputs are not mutated."""
        out = [g.detach().clone() for g in grads]
        ctx = StepContext(iteration=iteration, params=params, names=names, model=model,
                          inputs=None if inputs is None else inputs.detach())
        stages = self.apply_(out, ctx)
        return out, StepStats(iteration, stages)

    def _handle_nonfinite(self, grads: Sequence[Tensor], ctx: StepContext) -> None:
        counts = nonfinite_counts(list(grads))
        bad = [(i, c) for i, c in enumerate(counts) if c]
        if not bad:
            return
        if self.config.nonfinite == "raise":
            where = ", ".join(f"{ctx.name(i)} ({c} of {grads[i].numel()})" for i, c in bad)
            raise NonFiniteGradientError(
                f"{self.kind}: non-finite gradient entries in {where}; "
                "fix the training step or set nonfinite='zero' to zero them"
            )
        for i, _ in bad:
            torch.nan_to_num_(grads[i], nan=0.0, posinf=0.0, neginf=0.0)

    def _check_output(self, grads: Sequence[Tensor], ctx: StepContext) -> None:
        """Fail closed when the defense itself made an entry non-finite (noise too large for a 16-bit dtype,
        a subclass's arithmetic): always raises, whatever ``nonfinite`` says about the input."""
        where = nonfinite_where(list(grads), [ctx.name(i) for i in range(len(grads))])
        if where is not None:
            raise NonFiniteGradientError(
                f"{self.kind}: the defended gradient has non-finite entries in {where}; refused (noise too large "
                "for the dtype? float16 ends at 65504: lower the noise, or keep these parameters in float32)"
            )

    def _apply_(self, grads: list[Tensor], ctx: StepContext) -> StageStats:
        raise NotImplementedError

    # -- many clients at once (the attacker's simulation of the defense) ------------------------------
    def apply_batch_(self, grads: Sequence[Tensor], *, iteration: int = 1, params: Sequence[Tensor] | None = None,
                     names: Sequence[str] | None = None, batched_params: bool = False) -> None:
        """Defend N clients' gradients at once, in place: ``grads[j]`` is ``(N, *shape_j)``, row i the
        gradient of client i, which gets its own draw of the randomness (as N separate ``apply_`` calls
        would; only the streams differ). ``params``: the weights, ``(N, *shape_j)`` per client when
        ``batched_params`` else shared. No statistics are returned: this serves the red team's simulation
        of the defense over thousands of auxiliary batches (``guardfl.redteam.client.transmit``).

        The default applies ``apply_`` row by row. Defenses whose maths is per entry or per row override
        ``_apply_batch_`` with the same computation over the leading axis (one pass instead of N)."""
        n = grads[0].shape[0] if grads else 0
        if self.needs_params and params is None:
            raise ConfigError(f"{self.kind} needs the current weights: pass params=")
        if type(self)._apply_batch_ is Defense._apply_batch_:
            for i in range(n):
                p = None if params is None else [w[i] if batched_params else w for w in params]
                self.apply_(list(g[i] for g in grads), StepContext(iteration=iteration, params=p, names=names))
            return
        ctx = StepContext(iteration=iteration, params=params, names=names)
        self._handle_nonfinite(grads, ctx)
        with torch.no_grad():
            self._apply_batch_(list(grads), iteration, params, batched_params)
        self._check_output(grads, ctx)

    def _apply_batch_(self, grads: list[Tensor], iteration: int, params: Sequence[Tensor] | None,
                      batched_params: bool) -> None:
        """Override with a vectorised version of ``_apply_`` over the leading (client) axis."""
        raise NotImplementedError

    def __repr__(self) -> str:
        fields = self.config.model_dump(exclude={"kind"}, exclude_defaults=True)
        inner = ", ".join(f"{k}={v!r}" for k, v in fields.items())
        return f"{type(self).__name__}({inner})"
