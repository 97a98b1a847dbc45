"""``Defense.apply_batch_``: N clients' gradients at once, as N separate ``apply_`` calls would defend them.

The red team simulates the defense over thousands of auxiliary batches (learned inversion); the vectorised
versions must be the same defense: identical where it is deterministic (which entries are pruned, which
receive noise, the coin of Outpost), and the same distribution where it is random (the noise's scale).
"""

import pytest
import torch

from guardfl.defenses import GaussianNoise, GradPrune, Outpost, SignCompression, Stack
from guardfl.defenses.base import StepContext
from guardfl.errors import NonFiniteGradientError
from guardfl.ops.selection import largest_k_mask, largest_k_mask_rows, smallest_k_mask, smallest_k_mask_rows

SHAPES = [(6, 1, 5, 5), (6,), (10, 12)]


def _grads(n: int, seed: int = 0, zeros: float = 0.3) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for shape in SHAPES:
        g = torch.randn(n, *shape, generator=gen)
        g[torch.rand(n, *shape, generator=gen) < zeros] = 0.0  # dead ReLUs: ties at zero, broken by position
        out.append(g)
    return out


def _params(seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=gen) * 0.1 for shape in SHAPES]


def _assert_batch_is_rowwise(make, grads):
    """A fresh ``make()`` defending all rows at once equals another defending them one by one."""
    expected = _rowwise(make(), grads, _params())
    got = [g.clone() for g in grads]
    make().apply_batch_(got)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def _rowwise(defense, grads, params, iteration=1, batched=False):
    out = [g.clone() for g in grads]
    for i in range(grads[0].shape[0]):
        p = [w[i] for w in params] if batched else params
        defense.apply_([g[i] for g in out], StepContext(iteration=iteration, params=p))
    return out


@pytest.mark.parametrize("k", [0, 1, 7, 29, 30])
def test_row_masks_are_the_single_tensor_masks_of_each_row(k):
    values = _grads(5)[0].reshape(5, -1)[:, :30].abs()
    small, large = smallest_k_mask_rows(values, k), largest_k_mask_rows(values, k)
    for i in range(5):
        assert torch.equal(small[i], smallest_k_mask(values[i], k))
        assert torch.equal(large[i], largest_k_mask(values[i], k))
    assert (small.sum(1) == k).all()


@pytest.mark.parametrize("scope", ["layer", "global"])
def test_gradprune_batch_is_exactly_rowwise(scope):
    _assert_batch_is_rowwise(lambda: GradPrune(0.7, scope=scope), _grads(8))


def test_outpost_batch_prunes_and_picks_the_same_entries_and_noises_at_the_configured_scale():
    n = 400
    grads, params = _grads(n), _params()
    outpost = dict(beta=0.1, phi=0.4, prune=0.8, noise=0.8)
    quiet = _rowwise(Outpost(**{**outpost, "noise": 0.0}, seed=0), grads, params)  # the deterministic part
    got = [g.clone() for g in grads]
    Outpost(**outpost, seed=1).apply_batch_(got, params=params)  # seeded: the statistical bounds below, one draw
    for g, q, orig, w in zip(got, quiet, grads, params):
        rows, size = orig.reshape(n, -1).abs(), orig[0].numel()
        top = largest_k_mask_rows(rows, -(-4 * size // 10)).view_as(orig)  # phi = 40%, rounded up
        assert torch.equal(g[~top], q[~top])  # off the noised entries: exactly the pruned gradient
        noise = (g - q)[top]
        std = 0.8 * float(w.var(unbiased=False))
        assert abs(float(noise.std()) / std - 1) < 0.1 and abs(float(noise.mean())) < 0.1 * std


def test_outpost_batch_draws_one_coin_per_client_after_the_first_iteration():
    n = 2000
    grads, params = _grads(n), _params()
    got = [g.clone() for g in grads]
    Outpost(beta=0.1, seed=0).apply_batch_(got, iteration=12, params=params)  # seeded: a 3.6-sigma bound, one draw
    changed = torch.stack([(a != b).reshape(n, -1).any(1) for a, b in zip(got, grads)]).any(0)
    from guardfl.defenses.outpost import perturb_probability

    assert abs(float(changed.float().mean()) - perturb_probability(12, 0.1)) < 0.04
    untouched = ~changed
    assert all(torch.equal(a[untouched], b[untouched]) for a, b in zip(got, grads))


def test_outpost_batch_uses_each_clients_own_weights_under_fedavg():
    n = 300
    grads = _grads(n, zeros=0.0)
    params = [torch.cat([w.expand(n // 2, *w.shape), 10 * w.expand(n // 2, *w.shape)]) for w in _params()]
    got = [g.clone() for g in grads]
    Outpost(prune=0.0, phi=1.0, noise=1.0).apply_batch_(got, params=params, batched_params=True)
    d = (got[2] - grads[2]).reshape(n, -1)
    assert 80 < float(d[n // 2:].std() / d[: n // 2].std()) < 120  # Var(10 w) = 100 Var(w)


def test_defenses_without_a_vectorised_form_run_row_by_row_with_the_same_draws():
    for make in (lambda: GaussianNoise(0.1, seed=3), lambda: SignCompression()):
        _assert_batch_is_rowwise(make, _grads(5))


def test_a_stack_applies_its_members_in_order_to_every_client():
    _assert_batch_is_rowwise(lambda: Stack(GradPrune(0.5), GaussianNoise(0.01, seed=1)), _grads(6))


def test_non_finite_gradients_are_refused_in_a_batch_too():
    grads = _grads(3)
    grads[1][2, 0] = float("nan")
    with pytest.raises(NonFiniteGradientError, match="non-finite"):
        GradPrune(0.5).apply_batch_(grads)
    with pytest.raises(NonFiniteGradientError):
        Outpost().apply_batch_(grads, params=_params())
