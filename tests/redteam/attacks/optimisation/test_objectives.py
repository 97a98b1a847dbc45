import torch

from guardfl.redteam.attacks.optimisation import objectives as obj
from guardfl.redteam.attacks.optimisation.objectives import cosine_distance


def test_cosine_distance_is_accurate_over_a_resnet_sized_update():
    """11M float32 entries (ResNet-18's update): the distance of an update to itself is 0 and to a
    perturbed copy matches a float64 reference, so the true image is the optimum (not cos = 1.002)."""
    g = torch.Generator().manual_seed(0)
    obs = torch.randn(11_000_000, generator=g) * torch.rand(11_000_000, generator=g) ** 4
    sim = obs + 0.01 * torch.randn(11_000_000, generator=g) * obs.abs().mean()
    ref = 1 - torch.nn.functional.cosine_similarity(sim.double(), obs.double(), dim=0)
    assert abs(float(cosine_distance(obs, obs))) < 1e-6
    assert abs(float(cosine_distance(sim, obs)) - float(ref)) < 1e-6 + 1e-3 * float(ref)
    assert cosine_distance(sim, obs).dtype == torch.float32


def test_layerwise_distances_equal_the_flat_ones():
    """The engine sums its distances layer by layer (no flat copy of the update): the same values."""
    gen = torch.Generator().manual_seed(0)
    sim = [torch.randn(5, 3, generator=gen, dtype=torch.float64), torch.randn(7, generator=gen, dtype=torch.float64)]
    obs = [torch.randn(5, 3, generator=gen, dtype=torch.float64), torch.randn(7, generator=gen, dtype=torch.float64)]
    obs[0][obs[0].abs() < 0.5] = 0.0
    masks = [o != 0 for o in obs]
    flat_sim, flat_obs, flat_mask = obj.flatten(sim), obj.flatten(obs), obj.flatten(masks)
    assert torch.allclose(obj.cosine_distance_layers(sim, obs), obj.cosine_distance(flat_sim, flat_obs))
    assert torch.allclose(obj.cosine_distance_layers(sim, obs, masks), obj.cosine_distance(flat_sim, flat_obs, flat_mask))
    assert torch.allclose(obj.l2_distance_layers(sim, obs, masks), obj.l2_distance(flat_sim, flat_obs, flat_mask))
    assert torch.allclose(obj.sign_hinge_distance_layers(sim, [o.sign() for o in obs]),
                          obj.sign_hinge_distance(flat_sim, flat_obs.sign()))
    assert torch.allclose(obj.layers_norm(obs), flat_obs.norm())


def test_layerwise_cosine_of_a_large_update_with_itself_is_one():
    """11M float32 entries: the float64 sums keep cos(g, g) at 1 (a float32 flat norm is ~0.2% off)."""
    gen = torch.Generator().manual_seed(0)
    g = [torch.randn(2_400_000, generator=gen) * 1e-3 for _ in range(5)]
    assert abs(float(obj.cosine_distance_layers(g, g))) < 1e-6


def test_layerwise_cosine_gradient_is_autograds():
    """The hand-written backward of the layer-wise cosine: gradcheck in float64, with and without masks."""
    gen = torch.Generator().manual_seed(1)
    sim = [torch.randn(4, 3, generator=gen, dtype=torch.float64, requires_grad=True),
           torch.randn(6, generator=gen, dtype=torch.float64, requires_grad=True)]
    obs = [torch.randn(4, 3, generator=gen, dtype=torch.float64), torch.randn(6, generator=gen, dtype=torch.float64)]
    masks = [o.abs() > 0.3 for o in obs]
    assert torch.autograd.gradcheck(lambda *s: obj.cosine_distance_layers(list(s), obs), sim)
    assert torch.autograd.gradcheck(lambda *s: obj.cosine_distance_layers(list(s), obs, masks), sim)


def test_layerwise_cosine_under_vmap_is_the_loop():
    """Restarts vmap the distance: values and gradients equal one call per restart."""
    from torch.func import vmap

    gen = torch.Generator().manual_seed(2)
    obs = [torch.randn(50, 20, generator=gen), torch.randn(20, generator=gen)]
    sim = [torch.randn(3, 50, 20, generator=gen, requires_grad=True), torch.randn(3, 20, generator=gen, requires_grad=True)]
    batched = vmap(lambda a, b: obj.cosine_distance_layers([a, b], obs))(*sim)
    grads = torch.autograd.grad(batched.sum(), sim)
    for r in range(3):
        one = [s[r].detach().requires_grad_(True) for s in sim]
        value = obj.cosine_distance_layers(one, obs)
        assert torch.allclose(batched[r], value, atol=1e-6)
        for g, ref in zip(grads, torch.autograd.grad(value, one)):
            assert torch.allclose(g[r], ref, atol=1e-6, rtol=1e-5)
