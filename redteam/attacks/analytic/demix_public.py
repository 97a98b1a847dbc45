"""Decoding Inter-InstaHide with the public set known (pure functions).

Setting (Huang et al. 2020's Inter-InstaHide; the attack setting of Carlini et al. 2020, "An Attack on
InstaHide", and Huang et al. 2021, Sec. 4): each encoding mixes ONE private image x with k-1 DISTINCT
images of a public set P, then flips signs. For images in [0, hi] (guardfl's inputs) the absolute value
undoes the flips, so an encoding y = |e| (d pixels) is

    y = lam * x + sum_{j in S} c_j p_j,   lam + sum c_j = 1,  lam, c_j in [0, cap],  |S| = k - 1,

with x unknown and P known. The attacker knows k, the cap and P (the configuration: the public set is
public), never S, c, lam or the sign masks (the randomness). ``decode_public`` recovers x:

1. **Partners** (``identify_partners``): greedy sparse pursuit over the public dictionary, k-1 steps,
   on the images' neighbour differences (not the pixels: the private image's low frequencies, its mean
   and shading, correlate with every public image) and in the L1 norm: at each step the public image
   whose best weight lowers the L1 norm of the remaining differences most. A true partner is present
   pixel for pixel, so its edges cancel exactly; an unrelated image only correlates, and subtracting it
   adds edges (an L2 regression, tried first, picks correlated images far more often). Large public sets
   are screened to the ``screen`` images whose differences correlate most with the encoding's.
2. **Coefficients** (``fit_coefficients``): the weights minimising the L1 norm of the remaining
   differences (the total variation of the private part: the natural-image prior Huang et al. use in the
   attack itself), scaled down if needed so that the private part stays in the input box
   (``feasible_scale``: over-subtraction breaks the box, under-subtraction never does), c in [0, cap],
   lam = 1 - sum c in [``min_weight``, cap]; the single-encoding estimate is x = (y - sum c_j p_j) / lam in
   the box. With one encoding per private image (FedSGD) this is the answer: the component of x along its
   partners is not identifiable from one encoding, and the prior decides it (exact only when x shares no
   edge with its partners). Noise in the encodings is amplified by 1/lam.
3. **Combining encodings of one private image** (``group_encodings``, ``combine_group``): with E
   encodings per private image (FedAvg, E epochs: each private image is encoded once per epoch, with fresh
   partners, coefficients and masks), the encodings are grouped (Hungarian matching of each epoch's
   estimates to the first epoch's, as every private image occurs once per epoch) and each group is solved
   jointly: with u_a = 1/lam_a and v_a = c_a/lam_a every encoding gives x = u_a y_a - P_{S_a} v_a, linear
   in (u_a, v_a), with u_a - sum v_a = 1. Minimising the (lam^2-weighted) spread of those estimates under
   that constraint is a small equality-constrained least-squares problem whose solution is exact for
   noise-free encodings with the right partners, when the encodings share no partner (a shared partner p
   leaves x determined only up to x + t (p - x): the prior and the box decide). The partners are then
   re-identified with the group's estimate in the dictionary, and the group re-solved. A partner of weight
   ~0.1 or less can be mistaken for a partner of another encoding of the same image: a self-consistent
   wrong pair that leaves a faint ghost (not resolved; measured in the tests).

Deviations from Carlini et al.: they do not hold the public set (ImageNet in the InstaHide challenge; they
treat public images as noise) and learn a similarity network; holding the public set, we subtract the
public partners instead (the attacker this module models is strictly stronger on the public side), and
group encodings by the epoch structure of federated training instead of a learned similarity and a
clique search. Huang et al. 2021 grant the attacker the mixing indices and coefficients (their upper
bound, ``demix.oracle_demix``); this decoder is granted neither.
"""

from __future__ import annotations

import torch
from scipy.optimize import linear_sum_assignment
from torch import Tensor


def differences(images: Tensor) -> Tensor:
    """``(m, C, H, W)`` images -> ``(m, C*(H-1)*W + C*H*(W-1))`` vertical and horizontal neighbour
    differences (a linear high-pass: the features the partner regression runs on)."""
    return torch.cat([(images[..., 1:, :] - images[..., :-1, :]).flatten(1),
                      (images[..., :, 1:] - images[..., :, :-1]).flatten(1)], 1)


def _median_fit(a: Tensor, atoms: Tensor) -> Tensor:
    """For each row b of ``atoms`` (``(N, D)``), the scalar c minimising ||a - c b||_1: the weighted median
    of a_i / b_i with weights |b_i|."""
    ok = atoms.abs() > 1e-12
    ratio = torch.where(ok, a[None] / torch.where(ok, atoms, torch.ones_like(atoms)), torch.zeros_like(atoms))
    order = ratio.argsort(1)
    ratio, weight = ratio.gather(1, order), atoms.abs().gather(1, order)
    cum = weight.cumsum(1)
    idx = (cum < cum[:, -1:] / 2).sum(1).clamp(max=atoms.shape[1] - 1)
    return ratio.gather(1, idx[:, None])[:, 0]


def _l1_fit(a: Tensor, atoms: Tensor, c: Tensor, iterations: int = 10) -> Tensor:
    """c minimising ||a - c @ atoms||_1 (``atoms``: ``(j, D)``), by iteratively reweighted least squares
    from ``c``."""
    eye = torch.eye(atoms.shape[0], dtype=atoms.dtype)
    for _ in range(iterations):
        w = 1 / (a - c @ atoms).abs().clamp_min(1e-4)
        weighted = atoms * w[None]
        c = torch.linalg.solve(weighted @ atoms.T + 1e-10 * eye, weighted @ a)
    return c


def _pursuit(a: Tensor, atoms: Tensor, count: int, cap: float, fixed: Tensor | None, shortlist: int = 16,
             ) -> tuple[list[int], Tensor]:
    """Greedy L1 pursuit: ``count`` rows of ``atoms`` chosen one at a time, each the one whose best single
    weight (in [0, cap]) lowers ||residual||_1 most among the ``shortlist`` rows best correlated with the
    residual, all weights refitted (L1) after each choice; ``fixed``
    (``(D,)``, optional) is an atom always in the fit, listed first in the weights."""
    chosen: list[int] = []
    basis = fixed[None] if fixed is not None else atoms[:0]
    weights = _l1_fit(a, basis, _median_fit(a, basis)) if fixed is not None else a.new_zeros(0)
    residual = a - weights @ basis if fixed is not None else a
    norms = atoms.norm(dim=1).clamp_min(1e-12)
    for _ in range(count):
        corr = (atoms @ residual) / norms
        if chosen:
            corr[chosen] = -float("inf")
        short = corr.topk(min(shortlist, atoms.shape[0] - len(chosen))).indices  # the L1 test on the best-correlated
        c = _median_fit(residual, atoms[short]).clamp(0, cap)
        gain = residual.abs().sum() - (residual[None] - c[:, None] * atoms[short]).abs().sum(1)
        best = int(gain.argmax())
        j, c = int(short[best]), c[best : best + 1]
        chosen.append(j)
        basis = torch.cat([basis, atoms[j : j + 1]])
        weights = _l1_fit(a, basis, torch.cat([weights, c]))
        residual = a - weights @ basis
    return chosen, weights


def identify_partners(y: Tensor, public: Tensor, k: int, cap: float = 1.0, *, screen: int = 256,
                      extra: Tensor | None = None) -> Tensor:
    """``(m, k-1)`` indices into ``public`` (``(N, C, H, W)``): the public partners of each encoding of ``y``
    (``(m, C, H, W)``), by greedy L1 pursuit on the images' neighbour differences: at each step the public
    image whose best weight (in [0, ``cap``]) lowers the L1 norm of the remaining differences most, i.e.
    whose edges cancel exactly (a partner is present pixel for pixel; an unrelated image only correlates,
    and subtracting it adds edges). Large public sets are screened first to the ``screen`` images whose
    differences correlate most with the encoding's. ``extra`` (``(m, C, H, W)``, optional): the current
    private-image estimate of each encoding, always in the fit (when refining)."""
    n_pub = public.shape[0]
    if not 1 <= k - 1 <= n_pub:
        raise ValueError(f"k={k}: needs 1 <= k-1 <= {n_pub} public images")
    dy, dp = differences(y.double()), differences(public.double())
    de = differences(extra.double()) if extra is not None else None
    scores = (dy @ dp.T) / dp.norm(dim=1).clamp_min(1e-12)
    keep = min(n_pub, max(screen, k - 1))
    out = torch.empty(y.shape[0], k - 1, dtype=torch.long)
    for i in range(y.shape[0]):
        candidates = scores[i].topk(keep).indices
        chosen, _ = _pursuit(dy[i], dp[candidates], k - 1, cap, de[i] if de is not None else None)
        out[i] = candidates[torch.tensor(chosen)]
    return out


def _bounded(c: Tensor, cap: float, min_weight: float) -> tuple[Tensor, Tensor]:
    """c clipped to [0, cap], then scaled so that lam = 1 - sum c lies in [min_weight, cap]."""
    c = c.clamp(0, cap)
    total = c.sum(1, keepdim=True)
    target = total.clamp(1 - cap, 1 - min_weight)
    c = torch.where(total > 1e-12, c * target / total.clamp_min(1e-12), torch.full_like(c, (1 - cap) / c.shape[1]))
    c = c.clamp(0, cap)
    return 1 - c.sum(1), c


def feasible_scale(y: Tensor, mixed: Tensor, total: Tensor, value_range: tuple[float, float], *,
                   slack: float = 0.02) -> Tensor:
    """``(m,)`` the largest s in [0, 1] such that subtracting s times the partners' mix ``mixed`` (their
    weights summing to ``total``) leaves a private part lam * x with x in the box, lam = 1 - s * total:
    y - s mixed >= lam * lo and y - s mixed <= lam * hi, pixel by pixel, allowing the ``slack`` share of
    pixels to violate it (noise in reconstructed encodings). Over-subtraction breaks the box, while
    under-subtraction (s -> 0) never does, so this bounds the weights from above only."""
    lo, hi = value_range
    y, mixed = y.flatten(1).double(), mixed.flatten(1).double()
    t = total.double()[:, None]
    # y - s m >= (1 - s t) lo  <=>  s (m - t lo) <= y - lo ;  y - s m <= (1 - s t) hi  <=>  s (t hi - m) <= hi - y
    bounds = []
    for coef, room in ((mixed - t * lo, y - lo), (t * hi - mixed, hi - y)):
        ratio = torch.where(coef > 1e-12, room.clamp_min(0) / coef.clamp_min(1e-12), torch.full_like(coef, float("inf")))
        bounds.append(torch.quantile(ratio, slack, dim=1) if slack > 0 else ratio.min(1).values)
    return torch.minimum(torch.minimum(bounds[0], bounds[1]), torch.ones_like(bounds[0])).clamp_min(0)


def fit_coefficients(y: Tensor, partners: Tensor, cap: float, *, x: Tensor | None = None, min_weight: float = 0.02,
                     value_range: tuple[float, float] | None = None) -> tuple[Tensor, Tensor]:
    """(lam ``(m,)``, c ``(m, k-1)``) of each encoding of ``y`` given its partners (``(m, k-1, C, H, W)``).
    Without ``x``: the weights that minimise the L1 norm of the remaining differences, i.e. the total
    variation of the private-image estimate (the prior: a natural image has sparse edges; exact when the
    private image shares no edge with its partners). With ``x`` (``(m, C, H, W)``, the private-image estimate of each
    encoding): least squares of y - x on (p_j - x), i.e. y = lam x + sum c_j p_j with lam = 1 - sum c_j
    exactly. With ``value_range`` (no ``x``): the weights scaled down to what the input box allows
    (``feasible_scale``). Then c in [0, cap] and lam = 1 - sum c in [``min_weight``, cap] (c rescaled to meet it: a
    private weight near 0 leaves nothing to recover)."""
    m, j = partners.shape[:2]
    if x is None:
        a = differences(partners.double().flatten(0, 1)).reshape(m, j, -1)
        b = differences(y.double())
        c = torch.stack([_l1_fit(b[i], a[i], _median_fit(b[i], a[i]).clamp(0, cap)) for i in range(m)]).clamp(0, cap)
        if value_range is not None:  # never subtract more than the input box allows
            mixed = (partners.double() * c.reshape(m, j, *([1] * (partners.dim() - 2)))).sum(1)
            c = c * feasible_scale(y, mixed, c.sum(1), value_range)[:, None]
    else:
        a = (partners.double() - x.double()[:, None]).flatten(2)
        b = (y.double() - x.double()).flatten(1)
        c = torch.linalg.lstsq(a.transpose(1, 2), b[:, :, None]).solution[:, :, 0]
    return _bounded(c, cap, min_weight)


def subtract(y: Tensor, partners: Tensor, lam: Tensor, c: Tensor, value_range: tuple[float, float]) -> Tensor:
    """The private-image estimates (y - sum_j c_j p_j) / lam, in the input box."""
    shape = (-1,) + (1,) * (y.dim() - 1)
    mixed = (partners.double() * c.double().reshape(*c.shape, *([1] * (y.dim() - 1)))).sum(1)
    return ((y.double() - mixed) / lam.double().reshape(shape)).clamp(*value_range)


def group_encodings(estimates: Tensor, n: int) -> Tensor:
    """``(m,)`` group (private image) of each of m estimates: identity when m == n; with m = E*n (E epochs
    in step order, each private image once per epoch, in an unknown order within the epoch), each epoch's
    estimates matched one-to-one to the group means so far (Hungarian, squared distance), epoch by epoch
    from the first; other m: the nearest of the first n."""
    m = estimates.shape[0]
    flat = estimates.flatten(1).double()
    if m == n:
        return torch.arange(n)
    groups = torch.empty(m, dtype=torch.long)
    groups[:n] = torch.arange(n)
    centres, counts = flat[:n].clone(), torch.ones(n, dtype=flat.dtype)
    if m % n:
        groups[n:] = torch.cdist(flat[n:], centres).argmin(1)
        return groups
    for start in range(n, m, n):
        cost = torch.cdist(flat[start : start + n], centres / counts[:, None]).pow(2)
        rows, cols = linear_sum_assignment(cost.numpy())
        groups[start + torch.from_numpy(rows)] = torch.from_numpy(cols)
        centres = centres.clone()
        centres[torch.from_numpy(cols)] = centres[torch.from_numpy(cols)] + flat[start + torch.from_numpy(rows)]
        counts[torch.from_numpy(cols)] += 1
    return groups


def _kkt(y: Tensor, cols: Tensor, lam: Tensor, c: Tensor, prior: float) -> Tensor:
    """The linear step of ``combine_group``: z (g, k) minimising the weighted spread of x_a = cols_a^T z_a
    plus a small pull toward the prior, subject to u_a - sum v_a = 1."""
    g, kk = cols.shape[:2]
    z0 = torch.cat([1 / lam[:, None], c / lam[:, None]], 1)
    w = lam.pow(2) / lam.pow(2).sum()
    flat = cols.reshape(g * kk, -1)
    gram = flat @ flat.T
    wb = w.repeat_interleave(kk)
    h = -wb[:, None] * wb[None, :] * gram
    a_mat = torch.zeros(g, g * kk, dtype=y.dtype)
    for a in range(g):
        s = slice(a * kk, (a + 1) * kk)
        h[s, s] += w[a] * gram[s, s]
        a_mat[a, a * kk], a_mat[a, a * kk + 1 : (a + 1) * kk] = 1.0, -1.0
    scale = prior * float(torch.diagonal(h).abs().mean().clamp_min(1e-12))
    kkt = torch.zeros(g * kk + g, g * kk + g, dtype=y.dtype)
    kkt[: g * kk, : g * kk] = 2 * (h + scale * torch.eye(g * kk, dtype=y.dtype))
    kkt[: g * kk, g * kk :], kkt[g * kk :, : g * kk] = a_mat.T, a_mat
    rhs = torch.cat([2 * scale * z0.reshape(-1), torch.ones(g, dtype=y.dtype)])
    return torch.linalg.lstsq(kkt, rhs[:, None]).solution[: g * kk, 0].reshape(g, kk)


def _alternate(y: Tensor, partners: Tensor, x: Tensor, cap: float, value_range: tuple[float, float],
               iterations: int, min_weight: float) -> tuple[Tensor, Tensor, Tensor, float]:
    """Alternating least squares on sum_a ||y_a - lam_a x - partners_a^T c_a||^2 (the encodings' own
    residual): (lam_a, c_a) given x with lam_a = 1 - sum c_a, then x given them, in the box."""
    for _ in range(iterations):
        c = torch.linalg.lstsq((partners - x[None, None]).transpose(1, 2), (y - x[None])[:, :, None]).solution[:, :, 0]
        lam, c = _bounded(c, cap, min_weight)
        rest = y - (partners * c[:, :, None]).sum(1)
        x = ((lam[:, None] * rest).sum(0) / lam.pow(2).sum()).clamp(*value_range)
    c = torch.linalg.lstsq((partners - x[None, None]).transpose(1, 2), (y - x[None])[:, :, None]).solution[:, :, 0]
    lam, c = _bounded(c, cap, min_weight)
    residual = float((y - lam[:, None] * x[None] - (partners * c[:, :, None]).sum(1)).pow(2).mean())
    return x, lam, c, residual


def combine_group(y: Tensor, partners: Tensor, lam: Tensor, c: Tensor, cap: float, value_range: tuple[float, float], *,
                  iterations: int = 30, prior: float = 1e-9, min_weight: float = 0.02) -> tuple[Tensor, Tensor, Tensor]:
    """Joint estimate of the private image of g >= 2 encodings ``y`` (``(g, d)``) with partner images
    ``partners`` (``(g, k-1, d)``), from their single-encoding coefficients (lam, c).

    Linear step: with u_a = 1/lam_a, v_a = c_a/lam_a each encoding gives x_a = u_a y_a - partners_a^T v_a;
    minimise sum_a w_a ||x_a - xbar||^2 (w = lam^2, normalised; xbar the w-mean) + a pull of relative
    weight ``prior`` toward the single-encoding z, subject to u_a - sum v_a = 1: an equality-constrained
    least-squares problem in g*k unknowns (exact for noise-free encodings with the right partners). Then
    ``iterations`` of alternating least squares on the encodings' own residual, from that estimate and
    from the lam^2-weighted mean of the single-encoding estimates; the start with the lower residual wins
    (noise in the encodings can pull the linear step toward lam = 1, which the residual exposes). Returns
    (x (d,), lam (g,), c (g, k-1))."""
    y, partners, lam, c = y.double(), partners.double(), lam.double(), c.double()
    cols = torch.cat([y[:, None, :], -partners], 1)  # (g, k, d)
    z = _kkt(y, cols, lam, c, prior)
    u = z[:, 0].clamp_min(1.0)
    w = lam.pow(2) / lam.pow(2).sum()
    linear = (w[:, None] * (cols * torch.cat([u[:, None], z[:, 1:]], 1)[:, :, None]).sum(1)).sum(0)
    single = (w[:, None] * (y - (partners * c[:, :, None]).sum(1)) / lam[:, None]).sum(0)
    best = None
    for start in (linear, single):
        found = _alternate(y, partners, start.clamp(*value_range), cap, value_range, iterations, min_weight)
        if best is None or found[3] < best[3]:
            best = found
    return best[0], best[1], best[2]


def decode_public(y: Tensor, public: Tensor, n: int, k: int, cap: float, value_range: tuple[float, float], *,
                  rounds: int = 2, screen: int = 256) -> tuple[Tensor, Tensor, dict]:
    """Private-image estimates from m Inter-InstaHide encodings ``y`` (``(m, C, H, W)``, signs already
    undone: |encoding|) and the known public set ``public`` (``(N, C, H, W)``). Returns (X ``(n, C, H, W)``,
    the ``(m, n)`` 0/1 matrix of which encoding was attributed to which private image, info: the mean
    squared residual ||y - lam x - sum c p||^2 and the mean estimated private weight). ``rounds``: with
    several encodings per private image, how many times partners, groups and estimates are refined."""
    if y.shape[1:] != public.shape[1:]:
        raise ValueError(f"public images have shape {tuple(public.shape[1:])}, encodings {tuple(y.shape[1:])}")
    if n < 1 or y.shape[0] < n:
        raise ValueError(f"{y.shape[0]} encodings cannot hold {n} private images")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # thousands of tiny solves: a second intra-op thread only waits (and collapses on a busy host)
    try:
        return _decode_public(y, public, n, k, cap, value_range, rounds, screen)
    finally:
        torch.set_num_threads(threads)


def _decode_public(y: Tensor, public: Tensor, n: int, k: int, cap: float, value_range: tuple[float, float], rounds: int,
                   screen: int) -> tuple[Tensor, Tensor, dict]:
    y, public = y.double(), public.double()
    m, shape = y.shape[0], y.shape[1:]
    x = torch.zeros(n, *shape, dtype=y.dtype)
    support = identify_partners(y, public, k, cap, screen=screen)
    for r in range(max(1, rounds) if m > n else 1):
        if r:  # partners re-identified with each encoding's current private-image estimate in the dictionary
            support = identify_partners(y, public, k, cap, screen=screen, extra=x[groups])
        lam, c = fit_coefficients(y, public[support], cap, value_range=value_range)
        single = subtract(y, public[support], lam, c, value_range)
        groups = group_encodings(single, n)
        for i in range(n):
            members = (groups == i).nonzero()[:, 0]
            if len(members) == 1:  # one encoding of this image: the single-encoding estimate
                x[i] = single[members[0]]
            elif len(members) > 1:
                xi, lam_i, c_i = combine_group(y[members].flatten(1), public[support[members]].flatten(2), lam[members],
                                               c[members], cap, value_range)
                x[i], lam[members], c[members] = xi.reshape(shape), lam_i, c_i
    expand = (-1,) + (1,) * len(shape)
    fitted = lam.reshape(expand) * x[groups] + (public[support] * c.reshape(*c.shape, *([1] * len(shape)))).sum(1)
    weights = torch.zeros(m, n)
    weights[torch.arange(m), groups] = 1.0
    info = {"residual": float((y - fitted).pow(2).mean()), "private_weight": float(lam.mean())}
    return x.float(), weights, info
