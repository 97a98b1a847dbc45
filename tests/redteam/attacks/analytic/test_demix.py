"""Demixing MixUp / InstaHide encodings: the projection, the blind solver, the decode chain."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from guardfl.defenses import InstaHide, MixUp
from guardfl.redteam.attacks.base import Reconstruction
from guardfl.redteam.attacks.analytic.demix import demix, oracle_demix, project_capped_simplex
from guardfl.redteam.attacks.analytic.encoded import attack_view, decode, encoded_range
from guardfl.redteam.client.simulate import FedAvg, simulate_client


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 6), st.floats(0.3, 1.0), st.integers(0, 2**31 - 1))
def test_projection_lands_on_the_capped_sparse_simplex(k, cap, seed):
    cap = max(cap, 1.0 / k + 1e-3)
    v = torch.randn(7, 9, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    c = project_capped_simplex(v, cap, k)
    assert torch.allclose(c.sum(1), torch.ones(7, dtype=c.dtype), atol=1e-9)
    assert float(c.min()) >= 0 and float(c.max()) <= cap + 1e-6
    assert int((c > 0).sum(1).max()) <= k


def _images(n=12, side=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    base = torch.rand(n, 1, side // 2, side // 2, generator=g)  # smooth, distinct images
    return torch.nn.functional.interpolate(base, size=(side, side), mode="bilinear", align_corners=False)


def test_blind_demixing_beats_the_raw_encodings():
    x = _images()
    y = torch.arange(12) % 3
    enc = MixUp(k=3, max_coeff=0.65, seed=1)
    e = torch.cat([enc.encode(x, y, 3)[0] for _ in range(4)]).flatten(1)
    est, weights, residual = demix(e, 12, 3, 0.65, (0.0, 1.0))
    err = lambda a: float(torch.cdist(x.flatten(1), a).min(1).values.pow(2).mean())  # noqa: E731
    assert err(est) < 0.6 * err(e[:12])
    assert weights.shape == (48, 12) and residual < 1e-2


def test_oracle_demixing_is_exact_with_the_true_mixing_matrix():
    x = _images().flatten(1)
    c = project_capped_simplex(torch.rand(30, 12, dtype=torch.float64), 0.65, 3).float()
    assert torch.allclose(oracle_demix(c @ x, c, (0.0, 1.0)), x, atol=1e-4)


def test_view_and_decode_follow_the_known_encoding():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 3))
    x, y = _images(6), torch.arange(6) % 3
    obs = simulate_client(model, x, y, InstaHide(k=2), FedAvg(epochs=3, batch_size=3, lr=0.1))
    view = attack_view(obs, defense_known=True)
    assert view.num_samples == 18 and view.protocol.epochs == 1 and view.input_range == (-1.0, 1.0)
    assert attack_view(obs, defense_known=False) is obs
    encodings = torch.cat([e for e, _ in obs.side.trained])
    soft = torch.cat([s for _, s in obs.side.trained])
    decoded, kept = decode(Reconstruction(encodings, soft, 0.0), obs, defense_known=True)
    assert decoded.inputs.shape == x.shape and torch.equal(kept, encodings)
    assert float(decoded.inputs.min()) >= 0  # back in the private range
    assert encoded_range(MixUp(k=2).config, (0.0, 1.0)) == (0.0, 1.0)
