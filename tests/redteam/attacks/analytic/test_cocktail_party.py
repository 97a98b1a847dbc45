"""Cocktail Party Attack: whitening, unmixing of known sources, scale/sign without the truth, limits."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import linear_sum_assignment

from guardfl.redteam import FedAvg, ThreatModel, attacks, simulate_client
from guardfl.redteam.modality.image import metrics
from guardfl.redteam.attacks import CocktailParty, NotApplicable, Setting
from guardfl.redteam.attacks.analytic import ica
from guardfl.redteam.modality.image.data import lfw_faces
from guardfl.redteam.modality.image.models import FC2, LeNetZhu, set_model_state


@given(seed=st.integers(0, 2**31), k=st.integers(1, 6))
@settings(max_examples=20)
def test_whitening_gives_identity_covariance(seed, k):
    g = torch.randn(10, 500, generator=torch.Generator().manual_seed(seed)) * torch.linspace(0.1, 3, 10)[:, None]
    z, w, mean = ica.whiten(g, k)
    cov = z @ z.T / (z.shape[1] - 1)
    torch.testing.assert_close(cov, torch.eye(k), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(z, w @ (g - mean), atol=1e-4, rtol=1e-4)


def _matched_abs_corr(est: torch.Tensor, truth: torch.Tensor) -> torch.Tensor:
    c = torch.corrcoef(torch.cat([est, truth]))[: len(est), len(est) :].abs()
    rows, cols = linear_sum_assignment(-c.numpy())
    return c[rows, cols]


@pytest.mark.parametrize("kind", ["uniform", "laplace"])
def test_unmixing_recovers_known_independent_sources(kind):
    """Sub-Gaussian (uniform) and super-Gaussian (Laplace) sources, mixed by a random 20 x 5 matrix: the
    unmixed components match the sources (up to order and sign) with |correlation| > 0.95."""
    gen = torch.Generator().manual_seed(0)
    n, d = 5, 2000
    if kind == "uniform":
        x = torch.rand(n, d, generator=gen) * 2 - 1
    else:
        x = torch.empty(n, d).exponential_(generator=gen) - torch.empty(n, d).exponential_(generator=gen)
    a = torch.randn(20, n, generator=gen)
    attack = attacks.get("cocktail_party", iterations=800, lr=1e-2, restarts=3, tv=0.0, l1=0.0, sign_reg=0.0, decor=0.1, seed=0)
    m, _ = attack.unmix(a @ x, n, image_shape=None, noise_var=0.0, gen=gen)
    s = m @ (a @ x)
    assert float(_matched_abs_corr(s, x).min()) > 0.95


def test_bias_ratio_recovers_scale_sign_and_mean_from_the_update_alone():
    """An exact unmixing (any order, any scale, either sign) gives back the sources exactly through the
    bias relation: nothing but G and the bias update is read."""
    gen = torch.Generator().manual_seed(1)
    x = torch.rand(4, 300, generator=gen)
    a = torch.randn(12, 4, generator=gen)
    g, gb = a @ x, a @ torch.ones(4)
    perm, scale = torch.tensor([2, 0, 3, 1]), torch.tensor([3.0, -0.5, 1.0, -7.0])
    unmix = scale[:, None] * torch.linalg.pinv(a)[perm]
    torch.testing.assert_close(ica.bias_scale(unmix, g, gb), x[perm], atol=1e-4, rtol=1e-4)


def test_cpa_reconstructs_a_batch_of_faces_from_fc2_without_looking_at_them():
    x, y = lfw_faces(10)
    model = set_model_state(FC2((1, 25, 25), 10), "default", seed=0)
    obs = simulate_client(model, x[:8], y[:8])
    assert not hasattr(obs.side, "inputs")  # the observation holds no private images to read
    rec = attacks.get("cocktail_party", iterations=1000, lr=1e-2, restarts=2, seed=0).reconstruct(obs, ThreatModel(labels="known"))
    m = metrics.evaluate(rec, x[:8], y[:8])
    assert rec.inputs.shape == x[:8].shape and rec.info["scale_and_sign"] == "bias ratio"
    assert m["summary"]["ssim"]["best"] > 0.8  # at least one face recovered nearly exactly


def test_one_sample_is_recovered_exactly_and_fedavg_needs_no_hyperparameters():
    x, y = lfw_faces(10)
    model = set_model_state(FC2((1, 25, 25), 10), "default", seed=0)
    obs = simulate_client(model, x[:1], y[:1])
    rec = attacks.get("cocktail_party", iterations=10, seed=0).reconstruct(obs, ThreatModel(labels="known"))
    assert metrics.evaluate(rec, x[:1])["per_image"][0]["ssim"] > 0.99
    avg = simulate_client(model, x[:4], y[:4], None, FedAvg(epochs=1, batch_size=2, lr=0.01))
    setting = Setting.of(avg)
    assert CocktailParty.applicable(setting, ThreatModel(fedavg="unknown")) is None
    rec = attacks.get("cocktail_party", iterations=300, lr=1e-2, restarts=1, seed=0).reconstruct(avg, ThreatModel(fedavg="unknown"))
    assert rec.inputs.shape == x[:4].shape


def test_cnn_embeddings_are_unmixed_then_inverted(monkeypatch):
    x, y = lfw_faces(10)
    model = set_model_state(LeNetZhu((1, 25, 25), 10), "wide-init", seed=0)
    obs = simulate_client(model, x[:1], y[:1])
    rec = attacks.get("cocktail_party", iterations=10, fi_iterations=200, seed=0).reconstruct(obs, ThreatModel(labels="known"))
    assert "embedding" in rec.info["sources"] and rec.inputs.shape == x[:1].shape
    assert float(rec.info["feature_inversion_objective"]) < 0.5


def test_limits_are_reported_not_hidden():
    x, y = lfw_faces(10)
    fc2 = set_model_state(FC2((1, 25, 25), 10, hidden=4), "default", seed=0)
    reason = CocktailParty.applicable(Setting.of(simulate_client(fc2, x[:6], y[:6])))
    assert "4 neurons, fewer than the 6 samples" in reason
    conv_only = torch.nn.Sequential(torch.nn.Conv2d(1, 10, 25), torch.nn.Flatten())
    assert "needs a linear layer" in CocktailParty.applicable(Setting.of(simulate_client(conv_only, x[:2], y[:2])))
    obs = simulate_client(set_model_state(FC2((1, 25, 25), 10), "default", seed=0), x[:2], y[:2])
    obs.update["net.1.weight"][0, 0] = float("nan")
    with pytest.raises(NotApplicable, match="non-finite"):
        attacks.get("cocktail_party", iterations=5).reconstruct(obs)


def test_pruned_updates_are_re_estimated_over_the_kept_entries():
    x, y = lfw_faces(10)
    model = set_model_state(FC2((1, 25, 25), 10), "default", seed=0)
    obs = simulate_client(model, x[:4], y[:4], {"kind": "gradprune", "ratio": 0.5})
    rec = attacks.get("cocktail_party", iterations=500, lr=1e-2, restarts=1, seed=0).reconstruct(obs, ThreatModel(labels="known"))
    assert "masked least squares" in rec.info["scale_and_sign"]
    blind = attacks.get("cocktail_party", iterations=500, lr=1e-2, restarts=1, seed=0).reconstruct(obs, ThreatModel(labels="known", defense="unknown"))
    assert "masked" not in blind.info["scale_and_sign"]
    assert metrics.evaluate(rec, x[:4])["summary"]["ssim"]["mean"] >= metrics.evaluate(blind, x[:4])["summary"]["ssim"]["mean"] - 0.05
