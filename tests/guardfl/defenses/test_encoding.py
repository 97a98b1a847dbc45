import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from guardfl.defenses import InstaHide, MixUp, from_config
from guardfl.errors import ConfigError
from guardfl.ops.mixing import mixing_coefficients, sign_masks


@given(n=st.integers(1, 40), k=st.integers(2, 8), slack=st.floats(0.01, 1.0), seed=st.integers(0, 2**31))
def test_coefficients_sum_to_one_and_respect_the_bound(n, k, slack, seed):
    bound = min(1.0, 1.0 / k + slack * (1 - 1.0 / k))
    c = mixing_coefficients(n, k, bound, torch.Generator().manual_seed(seed))
    assert c.shape == (n, k) and bool((c >= 0).all())
    assert torch.allclose(c.sum(1), torch.ones(n), atol=1e-5)
    assert float(c.max()) <= bound + 1e-6


@given(seed=st.integers(0, 2**31))
def test_sign_masks_are_plus_minus_one_and_reproducible(seed):
    a = sign_masks((5, 3, 4, 4), torch.Generator().manual_seed(seed))
    b = sign_masks((5, 3, 4, 4), torch.Generator().manual_seed(seed))
    assert set(a.unique().tolist()) <= {-1.0, 1.0} and torch.equal(a, b)


@given(n=st.integers(2, 16), k=st.integers(2, 5), seed=st.integers(0, 2**31))
def test_label_mixing_matches_image_mixing(n, k, seed):
    """Images that ARE their one-hot labels: the encoded image must equal the mixed label."""
    classes = 6
    y = torch.randint(0, classes, (n,), generator=torch.Generator().manual_seed(seed))
    x = F.one_hot(y, classes).float().view(n, 1, 1, classes)
    enc, soft = MixUp(k=k, max_coeff=1.0, seed=seed).encode(x, y, classes)
    assert torch.allclose(enc.view(n, classes), soft, atol=1e-6)
    assert torch.allclose(soft.sum(1), torch.ones(n), atol=1e-5)


def test_instahide_flips_signs_of_the_mixup_and_is_seed_reproducible():
    x, y = torch.rand(8, 3, 6, 6), torch.arange(8) % 4
    a, la = InstaHide(seed=3).encode(x, y, 4)
    b, lb = InstaHide(seed=3).encode(x, y, 4)
    assert torch.equal(a, b) and torch.equal(la, lb)
    c, _ = InstaHide().encode(x, y, 4)
    d, _ = InstaHide().encode(x, y, 4)
    assert not torch.equal(c, d)  # OS entropy by default
    assert bool((a < 0).any()) and float(a.abs().max()) <= 1.0


def test_inter_instahide_mixes_public_images_and_only_private_labels():
    public = torch.rand(20, 1, 5, 5)
    x, y = torch.rand(4, 1, 5, 5), torch.tensor([0, 1, 2, 3])
    enc, soft = InstaHide(k=3, mode="inter", public=public, seed=0).encode(x, y, 4)
    assert enc.shape == x.shape
    assert torch.all(soft.sum(1) < 1.0) and torch.equal(soft.argmax(1), y)
    with pytest.raises(ConfigError, match="needs a public dataset"):
        InstaHide(mode="inter")


@pytest.mark.parametrize(
    "cfg, field",
    [({"kind": "mixup", "k": 1}, "mixup.k"), ({"kind": "mixup", "k": 4, "max_coeff": 0.25}, "(1/k, 1]"),
     ({"kind": "instahide", "max_coeff": 1.5}, "instahide.max_coeff"), ({"kind": "instahide", "mode": "extra"}, "instahide.mode")],
)
def test_bad_encoding_configs(cfg, field):
    with pytest.raises(ConfigError, match=field.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[").replace("]", r"\]")):
        from_config(cfg)
