"""Sign bits: faces read from which first-layer units fired, one bit per unit and round (ours, 2026-11-29;
adaptive to sign compression, and to any defense that keeps a gradient's exact zeros).

Sign compression sends ``sign(gradient)``: magnitudes are gone, so the bins of ``trap_weights`` read nothing
on inputs in [0, 1] (a row's gradient is its sample times one scalar, whose sign is the same on every
pixel). But an entry that is exactly zero stays zero: a first-layer unit that no sample of the batch fires
has a zero bias gradient, one that some sample fires a nonzero one. So each unit of each round tells the
server one bit: whether any sample crosses the unit's threshold. With units of its own making:

* a random unit direction ``w`` in pixel space; unit ``k`` is ``w + eps * u_k`` with threshold
  ``t_k + eps * u_k . c``, ``u_k`` a random combination of the ``basis`` lowest-frequency 2-D DCT functions
  (faces are smooth) made orthogonal to ``w``, ``c`` the auxiliary images' mean. Along ``w`` the batch's
  top sample ``x*`` has projection ``h``, and unit ``k`` fires for it exactly when
  ``u_k . (x* - c) > (t_k - h) / eps``; for no other sample while ``eps`` is small beside the gap between the
  top two projections;
* **the search** (``search_rounds``): thresholds spread over a window, the first from the auxiliary
  projections' range; the firing fraction crosses one half at ``t = h``, and each round narrows the window
  around the crossing (a window of 32 units each side);
* **the bits** (``rounds``): every threshold at the estimate of ``h``: unit ``k`` fired iff
  ``u_k . (x* - c) > 0``, one-bit compressed sensing of ``x*``; the read is ``c`` plus the back-projection
  ``sum_k (2 fired_k - 1) u_k``, scaled to the auxiliary images' typical norm in the basis;
* ``faces`` directions in turn, each its own top sample (the same sample can come out twice).

Every model is the honest one but for the first layer's weights and biases. No two rows are alike (|cos|
about 0.97 at the defaults), no threshold sequence is monotone, and each unit fires for one sample or none,
under the isolation check's flag of two: ``bench/bench_sign_bits.py`` measured its bit models passing every
check of ``inspect_model`` with the client's batch (its search then was one direction repeated, which is
refused: this search uses bit-like models instead).

Not applicable without auxiliary images (the mean face, the projections' range), or on a model that is not
``nn.Linear`` on the whole input -> ``nn.ReLU`` -> ``nn.Linear`` (a normalisation of the units moves their
thresholds with the batch). FedSGD only (a unit that fires in a later local step would count). A defense
that adds noise to every entry leaves no zero, so every unit reads as fired: the attack then returns no read
(grey placeholders, and the reason in its ``stopped`` line) rather than the mean face pushed in a random
direction. It is for what keeps zeros and makes no new ones (sign compression, no defense; a pruning
zeroes fired units' entries too, which read as silent). Measured in
docs/research/malicious-server.md section 23.
"""

from __future__ import annotations

import copy
import math

import torch
from pydantic import Field
from torch import Tensor

from guardfl.redteam.attacks.base import AttackConfig, Capabilities, Reconstruction
from guardfl.redteam.attacks.dense import TrapLayers, trap_layers
from guardfl.redteam.attacks.malicious.server import ServerAttack, fill_batch
from guardfl.redteam.attacks.registry import register
from guardfl.redteam.attacks.setting import Setting
from guardfl.redteam.client.simulate import ClientQuery, ModelRefused
from guardfl.redteam.threat import ThreatModel

#: the window the search narrows to, in units on each side of the crossing
WINDOW_UNITS = 32
#: the search's first window, in standard deviations of the auxiliary projections above their mean: the
#: top of 64 normal samples lies near 2.4, the fourth near 1.7
TAIL = (2.0, 4.0)


class SignBitsConfig(AttackConfig):
    #: faces read, one random direction each
    faces: int = Field(default=4, ge=1, le=64, json_schema_extra={"allowed": "an integer in [1, 64]"})
    #: rounds of bits per face, after the search
    rounds: int = Field(default=4, ge=1, le=256, json_schema_extra={"allowed": "an integer in [1, 256]"})
    #: rounds of threshold search per face
    search_rounds: int = Field(default=4, ge=1, le=16, json_schema_extra={"allowed": "an integer in [1, 16]"})
    #: the step off the direction (rows ``w + eps * u``)
    eps: float = Field(default=0.02, gt=0, le=1, json_schema_extra={"allowed": "a number in (0, 1]"})
    #: the share of the first layer's units left as the honest model's: they fire for many samples, so the
    #: layer's gradient is not one sample's (the gradient-concentration check)
    honest: float = Field(default=0.25, ge=0, lt=1, json_schema_extra={"allowed": "a number in [0, 1)"})
    #: the lowest-frequency DCT functions the random parts are drawn from (0: the pixels)
    basis: int = Field(default=150, ge=0, le=4096, json_schema_extra={"allowed": "an integer in [0, 4096]"})


def dct_basis(shape: tuple[int, ...], m: int) -> Tensor:
    """The ``m`` lowest-frequency 2-D DCT-II functions of an image of ``shape`` ``(C, H, W)`` (the same in
    every channel), as orthonormal columns ``(C*H*W, m)``; ``m`` 0 or past the size: the pixels."""
    c, h, w = shape
    d = c * h * w
    if m <= 0 or m >= d:
        return torch.eye(d, dtype=torch.float64)

    def cosines(n: int) -> Tensor:
        k = torch.arange(n, dtype=torch.float64)
        out = torch.cos(math.pi * (k[None, :] + 0.5) * k[:, None] / n) * math.sqrt(2 / n)
        out[0] /= math.sqrt(2)
        return out

    ch, cw = cosines(h), cosines(w)
    pairs = sorted(((i, j) for i in range(h) for j in range(w)), key=lambda p: (p[0] + p[1], p))
    per = -(-m // c)
    cols = [torch.outer(ch[i], cw[j]) for i, j in pairs[:per]]
    out = []
    for channel in range(c):
        for col in cols:
            full = torch.zeros(c, h, w, dtype=torch.float64)
            full[channel] = col
            out.append(full.flatten())
    return torch.stack(out[:m], 1)


def back_projection(directions: Tensor, fired: Tensor) -> Tensor:
    """One-bit compressed sensing's estimate of the direction of ``x* - c`` from ``directions`` ``(k, d)``
    and whether each unit fired: the sum of ``+-u_k``."""
    return ((fired.double() * 2 - 1)[:, None] * directions).sum(0)


def crossing(thresholds: Tensor, fired: Tensor) -> float:
    """Where the firing fraction crosses one half: the threshold that best splits ``fired`` into fired below
    it and silent above it (the fewest disagreements; the middle of the best run of ties)."""
    order = torch.argsort(thresholds)
    t, f = thresholds[order], fired[order].double()
    silent_below = torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(1 - f, 0)])
    fired_above = torch.cat([torch.flip(torch.cumsum(torch.flip(f, [0]), 0), [0]), torch.zeros(1, dtype=torch.float64)])
    errors = silent_below + fired_above  # split after i units: the units below should fire, those above not
    best = torch.nonzero(errors == errors.min()).flatten()
    i = int(best[len(best) // 2])
    if i == 0:
        return float(t[0])
    if i == len(t):
        return float(t[-1])
    return float((t[i - 1] + t[i]) / 2)


@register
class SignBits(ServerAttack):
    """Faces read from which first-layer units fired: a malicious server against sign compression."""

    name = "sign_bits"
    one_round_reads = False  # one bit per unit and round: not through a fresh encoding each round
    Config = SignBitsConfig
    capabilities = Capabilities(protocols=frozenset({"fedsgd"}), server="malicious", needs_aux=True,
                                threat=frozenset())  # reads no label and adapts to no defense setting: it reads zeros
    budgets = {"quick": {}, "paper": {"faces": 8, "rounds": 16}}
    paper_budget = "ours (2026-11-29): search_rounds + rounds queries per face"

    @classmethod
    def _refuses(cls, setting: Setting, threat: ThreatModel) -> str | None:
        if len(setting.input_shape) != 3:
            return "sign bits read images (C, H, W)"
        if threat.aux is not None and len(threat.aux.images) < 2:
            return "needs 2 or more auxiliary images (their mean face and the spread of their projections)"
        found = trap_layers(setting.model, tuple(setting.input_shape))
        if isinstance(found, str):
            return found
        if found.norm is not None:
            return f"the first layer's units go through {type(found.norm).__name__}, which moves their thresholds with the batch"
        return None

    @staticmethod
    def _fired(client: ClientQuery, setting: Setting, layers: TrapLayers, rows: Tensor, thresholds: Tensor,
               shift: Tensor) -> Tensor:
        """Sends the honest model with the first layer's units ``rows`` firing above ``thresholds + shift``;
        which units fired for some sample (a nonzero bias gradient in what the client sent)."""
        sent = copy.deepcopy(setting.model)
        first, k = dict(sent.named_modules())[layers.first_name], len(rows)
        with torch.no_grad():  # the first k units measure; the others stay the honest model's
            first.weight[:k] = rows.to(first.weight)
            first.bias[:k] = (-(thresholds + shift)).to(first.bias)
        return client(sent).update[f"{layers.first_name}.bias"][:k].detach().cpu().double() != 0

    def _units(self, w: Tensor, basis: Tensor, c: Tensor, gen: torch.Generator, units: int) -> tuple[Tensor, Tensor, Tensor]:
        """``units`` rows ``w + eps u_k``, their random parts ``u_k`` and the shift ``eps u_k . c``."""
        u = torch.randn(units, basis.shape[1], generator=gen, dtype=torch.float64) @ basis.T
        u = u - (u @ w)[:, None] * w[None, :]
        return w[None, :] + self.config.eps * u, u, self.config.eps * (u @ c)

    def _measuring(self, layers: TrapLayers) -> int:
        """The first layer's units that measure (the rest stay honest): all but ``honest`` of them."""
        return max(1, layers.first.out_features - round(self.config.honest * layers.first.out_features))

    def _search(self, client: ClientQuery, setting: Setting, layers: TrapLayers, w: Tensor, projections: Tensor,
                basis: Tensor, c: Tensor, gen: torch.Generator) -> float | None:
        """The batch's top projection along ``w``: thresholds drawn in a window of the upper tail the
        auxiliary ``projections`` predict (``TAIL``, in their standard deviations: above the batch's fourth
        sample, so that no unit fires for more than a few samples, under the isolation check's count), moved
        down (none fired) or up (all fired) a window at a time, else narrowed around the crossing. None when
        no round was bracketed and every unit always read as fired: a defense that leaves no entry zero
        (noise on every entry), through which there are no bits to read."""
        units = self._measuring(layers)
        mu, sd = float(projections.mean()), float(projections.std())
        lo, hi = mu + TAIL[0] * sd, mu + TAIL[1] * sd
        h, silent = None, False
        for _ in range(self.config.search_rounds):
            rows, _, shift = self._units(w, basis, c, gen, units)
            t = lo + (hi - lo) * torch.rand(units, generator=gen, dtype=torch.float64)
            fired = self._fired(client, setting, layers, rows, t, shift)
            width = hi - lo
            silent = silent or not fired.all()
            if not fired.any():
                lo, hi = lo - width, lo
            elif fired.all():
                lo, hi = hi, hi + width
            else:
                h = crossing(t, fired)
                lo, hi = h - width * WINDOW_UNITS / units, h + width * WINDOW_UNITS / units
        if h is None:
            return (lo + hi) / 2 if silent else None
        return h

    def _read_face(self, client: ClientQuery, setting: Setting, layers: TrapLayers, aux: Tensor, basis: Tensor,
                   gen: torch.Generator) -> Tensor | None:
        """One face: a random direction, the search for its top projection, the bits, the back-projection
        (None: no unit was ever silent, nothing to read)."""
        c, units, d = aux.mean(0), self._measuring(layers), aux.shape[1]
        w = torch.randn(d, generator=gen, dtype=torch.float64)
        w /= w.norm()
        h = self._search(client, setting, layers, w, aux @ w, basis, c, gen)
        if h is None:
            return None
        estimate = torch.zeros(d, dtype=torch.float64)
        for _ in range(self.config.rounds):
            rows, u, shift = self._units(w, basis, c, gen, units)
            at_h = torch.full((units,), h, dtype=torch.float64)
            estimate += back_projection(u, self._fired(client, setting, layers, rows, at_h, shift))
        norm = float(((aux - c) @ basis).norm(dim=1).mean())
        coef = estimate @ basis
        return c + basis @ (coef / coef.norm().clamp_min(1e-12) * norm)

    def _interrogate(self, client: ClientQuery, setting: Setting, threat: ThreatModel, device: torch.device,
                     gen: torch.Generator) -> Reconstruction:
        shape, cfg = tuple(setting.input_shape), self.config
        aux = threat.aux.images.flatten(1).double().cpu()
        basis = dct_basis(shape, cfg.basis)
        layers = trap_layers(setting.model, shape)
        reads, stopped = [], {}
        for _ in range(cfg.faces):
            try:
                read = self._read_face(client, setting, layers, aux, basis, gen)
            except ModelRefused as refused:  # the faces already read are the server's: it keeps them
                if not reads:
                    raise
                stopped = {"stopped": f"after {len(reads)} of {cfg.faces} faces: the client's {refused.by} refused a model "
                                      f"({'; '.join(refused.reasons)[:200]})"}
                break
            if read is None:  # every unit fired in every search round: the defense leaves no zero to read
                stopped = {"stopped": "no unit was ever silent in what the client sent (a defense that leaves no entry "
                                      "zero, as noise on every entry does): no bits to read"}
                break
            reads.append(read)
        empty = torch.zeros((0, *shape))
        images = torch.stack(reads).float().clamp(*setting.input_range).view(-1, *shape) if reads else empty
        images = fill_batch(images, setting.num_samples, setting.input_range)
        return Reconstruction(images, torch.zeros(setting.num_samples, dtype=torch.long), 0.0, [], {
            "labels": "not restored", "faces": cfg.faces, "rounds": f"{cfg.search_rounds} of search and {cfg.rounds} of bits per face",
            "basis": f"{cfg.basis} lowest DCT functions" if 0 < cfg.basis < math.prod(shape) else "pixels",
            "eps": cfg.eps, **stopped, "malicious_model": type(setting.model).__name__})

