import torch
from hypothesis import given
from hypothesis import strategies as st

from guardfl.defenses import GradPrune
from guardfl.ops.selection import prune_count
from tests.strategies import gradient_lists

ratios = st.integers(1, 99).map(lambda x: x / 100)


def _check_pruned(before: torch.Tensor, after: torch.Tensor, k: int):
    """Exactly the k smallest magnitudes are zeroed, every other entry is untouched."""
    b, a = before.reshape(-1), after.reshape(-1)
    assert torch.all((a == b) | (a == 0))
    mag_b = b.abs().sort().values
    mag_a = a.abs().sort().values
    assert torch.all(mag_a[:k] == 0)
    assert torch.equal(mag_a[k:], mag_b[k:])  # the n-k largest magnitudes are kept
    changed = int(((a != b)).sum())
    assert changed <= k


@given(grads=gradient_lists(), ratio=ratios)
def test_layer_scope_prunes_exact_count_per_layer(grads, ratio):
    out, stats = GradPrune(ratio)(grads)
    (stage,) = stats.stages
    for g, o, layer in zip(grads, out, stage.layers):
        k = prune_count(ratio, g.numel())
        _check_pruned(g, o, k)
        changed = int((o != g).sum())  # the k smallest less those already zero
        assert layer.fraction_zeroed == layer.fraction_changed == changed / g.numel()
    assert stage.fired == any(not torch.equal(g, o) for g, o in zip(grads, out))


@given(grads=gradient_lists(), ratio=ratios)
def test_global_scope_prunes_exact_count_over_the_model(grads, ratio):
    out, stats = GradPrune(ratio, scope="global")(grads)
    flat_in = torch.cat([g.reshape(-1) for g in grads])
    flat_out = torch.cat([o.reshape(-1) for o in out])
    k = prune_count(ratio, flat_in.numel())
    _check_pruned(flat_in, flat_out, k)
    for g, o, layer in zip(grads, out, stats.stages[0].layers):
        assert round(layer.fraction_zeroed * layer.numel) == int((o != g).sum())
    assert stats.fired == (not torch.equal(flat_in, flat_out))


def test_per_layer_threshold_is_per_layer():
    """A layer of tiny gradients keeps its own top 20%: a global threshold would wipe it out."""
    big, tiny = torch.randn(1000) * 100, torch.randn(1000) * 1e-6
    (out_big, out_tiny), _ = GradPrune(0.8)([big, tiny])
    assert int((out_tiny != 0).sum()) == 200 and int((out_big != 0).sum()) == 200
    (_, out_tiny_g), _ = GradPrune(0.8, scope="global")([big, tiny])
    assert int((out_tiny_g != 0).sum()) == 0
