import torch

from guardfl.redteam.attacks.objectives import cosine_distance


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
