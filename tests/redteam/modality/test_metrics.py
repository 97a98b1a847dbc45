import math

import pytest
import torch
import torchvision
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import maximum_bipartite_matching

from guardfl.redteam.modality.image import metrics


def test_matching_undoes_a_permutation(faces):
    x = faces[:5]
    out = metrics.evaluate(x[[3, 0, 4, 1, 2]], x)
    s = out["summary"]
    assert s["mse"]["worst"] == 0 and s["ssim"]["mean"] == pytest.approx(1.0)
    assert [r["matched"] for r in out["per_image"]] == [1, 3, 4, 0, 2]


def test_summary_best_is_the_most_leaking(faces):
    x = faces[:3]
    noisy = (x + torch.tensor([0.0, 0.1, 0.3]).view(3, 1, 1, 1) * torch.randn_like(x)).clamp(0, 1)
    out = metrics.evaluate(noisy, x)
    ssims = [r["ssim"] for r in out["per_image"]]
    assert out["summary"]["ssim"]["best"] == max(ssims) == pytest.approx(1.0)
    assert out["summary"]["psnr"]["best"] == math.inf
    assert out["summary"]["ssim"]["worst"] == min(ssims)


def test_lpips_unavailable_offline_is_reported_not_faked(faces, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    metrics._lpips_model.cache_clear()
    out = metrics.evaluate(faces[:2], faces[:2])
    assert out["lpips"]["available"] is False and "AlexNet" in out["lpips"]["reason"]
    assert out["summary"]["lpips"] is None and out["per_image"][0]["lpips"] is None
    metrics._lpips_model.cache_clear()


def test_lpips_loads_alexnet_weights_from_a_path(faces, tmp_path):
    """Plumbing only: a randomly initialised AlexNet saved to disk stands in for the ImageNet weights."""
    path = tmp_path / metrics.ALEXNET_FILE
    torch.save(torchvision.models.alexnet(weights=None).state_dict(), path)
    metrics._lpips_model.cache_clear()
    out = metrics.evaluate(faces[:2], faces[:2], lpips_weights=str(path))
    assert out["lpips"]["available"] is True
    assert out["summary"]["lpips"]["mean"] == pytest.approx(0.0, abs=1e-6)
    metrics._lpips_model.cache_clear()


def test_shape_mismatch_is_an_error(faces):
    with pytest.raises(ValueError, match="shape"):
        metrics.evaluate(faces[:2], faces[:3])


@pytest.mark.parametrize("shape", [(1, 25, 25), (3, 32, 32), (1, 8, 8), (3, 20, 14)])
def test_ssim_matrix_is_ssim_of_every_pair(shape):
    gen = torch.Generator().manual_seed(0)
    truth = torch.rand(5, *shape, generator=gen)
    recon = (0.6 * truth[[2, 0, 1, 4, 3]] + 0.4 * torch.rand(5, *shape, generator=gen)).clamp(0, 1)
    s = metrics.ssim_matrix(recon, truth, 1.0)
    for i in range(5):
        for j in range(5):
            assert s[i, j] == pytest.approx(metrics.ssim(recon[j], truth[i], 1.0), abs=1e-5)


def _bright_face_and_dark_face(faces):
    """Two private faces and two reconstructions: one recovers the mid-grey face exactly, the other is a
    white guess. The least total MSE hands the exact one to the dark face (its error to the dark face
    plus the white guess's to the grey one undercuts the white guess's error to the dark face)."""
    truth = torch.stack([0.2 + 0.3 * faces[0], 0.1 * faces[1]])
    recon = torch.stack([truth[0], torch.ones_like(truth[0])])
    return recon, truth


def test_least_mse_matching_can_hide_an_exact_recovery(faces):
    recon, truth = _bright_face_and_dark_face(faces)
    assert list(metrics.match(recon, truth)) == [1, 0]  # the exact recovery matched to the other face
    out = metrics.evaluate(recon, truth)
    assert max(r["ssim"] for r in out["per_image"]) < 0.95


def test_matching_for_exact_pairs_keeps_the_exact_recovery(faces):
    recon, truth = _bright_face_and_dark_face(faces)
    assert list(metrics.match(recon, truth, exact_ssim=0.95)) == [0, 1]
    out = metrics.evaluate(recon, truth, exact_ssim=0.95)
    assert out["per_image"][0]["ssim"] == pytest.approx(1.0) and out["per_image"][0]["matched"] == 0
    assert "SSIM >= 0.95" in out["notes"]


def test_the_image_modality_matches_for_exact_pairs(faces):
    from guardfl.redteam.modality.image import EXACT_SSIM, IMAGE

    recon, truth = _bright_face_and_dark_face(faces)
    out = IMAGE.evaluate(recon, truth, None, input_range=(0.0, 1.0))
    assert out["per_image"][0]["matched"] == 0 and f"SSIM >= {EXACT_SSIM:g}" in out["notes"]


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 7), st.integers(1, 7), st.integers(0, 2**31 - 1))
def test_matching_keeps_as_many_exact_pairs_as_any_one_to_one_assignment(n, k, seed):
    """Property: the private images recovered exactly after matching are as many as any one-to-one
    assignment could give (a maximum bipartite matching of the exact pairs), never fewer than least-MSE's;
    reconstructions are copies, mixtures and noisy versions of private images, repeated as fill_batch does."""
    gen = torch.Generator().manual_seed(seed)
    truth = torch.rand(n, 1, 12, 12, generator=gen)
    picks = torch.randint(0, n, (k,), generator=gen)
    mix = (torch.rand(k, 1, 1, 1, generator=gen) * 1.2).clamp(max=1.0)  # some exact copies
    recon = mix * truth[picks] + (1 - mix) * torch.rand(k, 1, 12, 12, generator=gen)
    recon = recon.repeat(-(-n // k), 1, 1, 1)[:n]
    s = metrics.ssim_matrix(recon, truth, 1.0)
    exact = lambda perm: sum(s[i, perm[i]] >= 0.95 for i in range(n))  # noqa: E731
    best = maximum_bipartite_matching(csr_matrix(s >= 0.95), perm_type="column")
    assert exact(metrics.match(recon, truth, exact_ssim=0.95)) == int((best >= 0).sum()) >= exact(metrics.match(recon, truth))


def test_each_row_names_the_read_it_copies(faces):
    from guardfl.redteam.attacks.malicious.server import fill_batch

    reads = faces[:3]
    filled = fill_batch(reads, 8, (0.0, 1.0))  # the attack's 3 reads repeated to 8
    assert metrics.first_copies(filled) == [0, 1, 2, 0, 1, 2, 0, 1]
    out = metrics.evaluate(filled, faces[:8])
    assert {r["read"] for r in out["per_image"]} == {0, 1, 2}
    assert all(r["read"] == metrics.first_copies(filled)[r["matched"]] for r in out["per_image"])
    assert metrics.first_copies(faces[:4]) == [0, 1, 2, 3]  # distinct reads are their own
