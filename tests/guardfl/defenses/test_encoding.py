import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from guardfl.defenses import InstaHide, MixUp, from_config
from guardfl.errors import ConfigError
from guardfl.ops.mixing import batch_partners, mixing_coefficients, public_partners, sign_masks


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


@given(data=st.data(), k=st.integers(2, 5), seed=st.integers(0, 2**31))
def test_label_mixing_matches_image_mixing(data, k, seed):
    """Images that ARE their one-hot labels: the encoded image must equal the mixed label."""
    n, classes = data.draw(st.integers(k, 16), label="n"), 6
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


# -- the k images of a mix are k distinct images: max_coeff bounds each distinct image's total weight ----

def _one_hot_images(n: int, dim: int, offset: int = 0) -> torch.Tensor:
    """Image i is the basis vector e_(offset + i) of R^dim, shaped (n, 1, 1, dim)."""
    return F.one_hot(torch.arange(n) + offset, dim).float().view(n, 1, 1, dim)


def _assert_per_image_weights(weights: torch.Tensor, k: int, bound: float) -> None:
    """``weights[i, j]``: weight of distinct image j in encoded image i (private image i is column i)."""
    n = weights.shape[0]
    assert float(weights.max()) <= bound + 1e-6  # the reported symptom: no image above the bound
    assert torch.allclose(weights.sum(1), torch.ones(n), atol=1e-5)
    assert bool((weights[torch.arange(n), torch.arange(n)] > 0).all())  # the private image itself is in
    assert torch.equal((weights > 0).sum(1), torch.full((n,), k))  # k distinct images (|N(0,1)| draws > 0 a.s.)


def _bound(k: int, slack: float) -> float:
    return min(1.0, 1.0 / k + slack * (1 - 1.0 / k))


@settings(deadline=None)
@given(data=st.data(), k=st.integers(2, 6), slack=st.floats(0.01, 1.0), seed=st.integers(0, 2**31),
       insta=st.booleans())
def test_intra_mixing_bounds_the_weight_of_every_distinct_image(data, k, slack, seed, insta):
    n = data.draw(st.integers(k, 40), label="n")
    bound = _bound(k, slack)
    x, y = _one_hot_images(n, n), torch.arange(n) % 3
    defense = InstaHide(k=k, max_coeff=bound, seed=seed) if insta else MixUp(k=k, max_coeff=bound, seed=seed)
    enc, _ = defense.encode(x, y, 3)
    _assert_per_image_weights(enc.view(n, n).abs(), k, bound)  # InstaHide: signs flipped, |.| = weight


@settings(deadline=None)
@given(data=st.data(), k=st.integers(2, 6), slack=st.floats(0.01, 1.0), seed=st.integers(0, 2**31))
def test_inter_mixing_bounds_the_weight_of_every_distinct_image(data, k, slack, seed):
    n = data.draw(st.integers(1, 30), label="n")
    pool = data.draw(st.integers(k - 1, 30), label="public")
    bound, dim = _bound(k, slack), n + pool
    x, public = _one_hot_images(n, dim), _one_hot_images(pool, dim, offset=n)  # public: other coordinates
    enc, soft = InstaHide(k=k, max_coeff=bound, mode="inter", public=public, seed=seed).encode(x, torch.zeros(n), 2)
    weights = enc.view(n, dim).abs()
    _assert_per_image_weights(weights, k, bound)
    assert torch.equal((weights[:, :n] > 0).sum(1), torch.ones(n, dtype=torch.long))  # no other private image
    assert torch.allclose(soft[:, 0], weights[torch.arange(n), torch.arange(n)], atol=1e-6)


@given(data=st.data(), k=st.integers(2, 6), seed=st.integers(0, 2**31))
def test_partners_are_distinct_and_reproducible(data, k, seed):
    n = data.draw(st.integers(k, 50), label="n")
    p = batch_partners(n, k, torch.Generator().manual_seed(seed))
    assert p.shape == (n, k) and torch.equal(p[:, 0], torch.arange(n)) and bool(((p >= 0) & (p < n)).all())
    assert all(len(set(row)) == k for row in p.tolist())
    assert torch.equal(p, batch_partners(n, k, torch.Generator().manual_seed(seed)))
    pool = data.draw(st.integers(k - 1, 50), label="pool")
    q = public_partners(n, k, pool, torch.Generator().manual_seed(seed))
    assert q.shape == (n, k - 1) and bool(((q >= 0) & (q < pool)).all())
    assert all(len(set(row)) == k - 1 for row in q.tolist())


def test_partners_are_uniform_without_replacement():
    """n=5, k=3: each ordered pair of distinct partners (a, b) != own index, 12 of them, equally likely."""
    n, k, reps = 5, 3, 4000
    g = torch.Generator().manual_seed(1)
    rows = torch.stack([batch_partners(n, k, g) for _ in range(reps)])  # (reps, n, k)
    counts = torch.zeros(n, n, n)
    for i in range(n):
        a, b = rows[:, i, 1], rows[:, i, 2]
        counts[i].index_put_((a, b), torch.ones(reps), accumulate=True)
    for i in range(n):
        c = counts[i]
        allowed = torch.ones(n, n, dtype=torch.bool)
        allowed[i, :] = allowed[:, i] = False
        allowed.fill_diagonal_(False)
        assert float(c[~allowed].sum()) == 0
        expected = reps / 12
        assert float((c[allowed] - expected).abs().max()) < 5 * expected**0.5  # ~5 sigma


def test_no_private_image_exceeds_the_bound_through_protect():
    """The user's report: MixUp(k=4, max_coeff=0.65) on one-hot images, batch 8, 200 batches: no encoded
    image may carry any one private image at more than 0.65 (255 of 1,600 did, up to 0.996)."""
    from torch.utils.data import DataLoader, TensorDataset

    import guardfl

    n = 1600
    data = TensorDataset(_one_hot_images(n, n), torch.arange(n) % 3)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(n, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _, _, loader = guardfl.protect(model, opt, DataLoader(data, batch_size=8, shuffle=True), MixUp(k=4, max_coeff=0.65, seed=0))
    batches = list(loader)
    assert len(batches) == 200
    weights = torch.cat([x.view(-1, n) for x, _ in batches])
    assert int((weights > 0.65 + 1e-6).sum()) == 0
    assert torch.equal((weights > 0).sum(1), torch.full((n,), 4))
    assert torch.allclose(weights.sum(1), torch.ones(n), atol=1e-5)


@pytest.mark.parametrize("defense", [MixUp(k=4, seed=0), InstaHide(k=4, seed=0)], ids=["mixup", "instahide"])
def test_a_batch_smaller_than_k_is_refused(defense):
    msg = rf"{defense.kind}\.k: k=4 .* at least 4 distinct images .*got a batch of 3.*drop_last=True"
    with pytest.raises(ConfigError, match=msg):
        defense.encode(torch.rand(3, 1, 4, 4), torch.arange(3), 3)
    enc, soft = defense.encode(torch.rand(0, 1, 4, 4), torch.zeros(0, dtype=torch.long), 3)  # empty: nothing sent
    assert enc.shape == (0, 1, 4, 4) and soft.shape == (0, 3)
    assert defense.encode(torch.rand(4, 1, 4, 4), torch.arange(4) % 3, 3)[0].shape == (4, 1, 4, 4)  # n = k is fine


def test_inter_mode_needs_k_minus_1_public_images_but_any_batch():
    msg = r"instahide\.public: the public set has 2 images; mode 'inter' with k=4 needs at least k-1 = 3"
    with pytest.raises(ConfigError, match=msg):
        InstaHide(k=4, mode="inter", public=torch.rand(2, 1, 4, 4))
    defense = InstaHide(k=4, mode="inter", public=torch.rand(3, 1, 4, 4), seed=0)
    assert defense.encode(torch.rand(1, 1, 4, 4), torch.zeros(1, dtype=torch.long), 2)[0].shape == (1, 1, 4, 4)


def test_protect_refuses_a_loader_with_too_small_batches_before_training():
    from torch.utils.data import DataLoader, TensorDataset

    import guardfl

    data = TensorDataset(torch.rand(10, 1, 4, 4), torch.arange(10) % 3)

    def protect(loader, defense):
        model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 3))
        return guardfl.protect(model, torch.optim.SGD(model.parameters(), lr=0.1), loader, defense)[2]

    with pytest.raises(ConfigError, match=r"mixup\.k: .*batch_size is 3.*allowed: 2 <= k <= batch size"):
        protect(DataLoader(data, batch_size=3), MixUp(k=4))
    with pytest.raises(ConfigError, match=r"instahide\.k: .*last batch has 2: 10 samples, batch_size 8.*drop_last=True"):
        protect(DataLoader(data, batch_size=8), InstaHide(k=4))
    assert [len(x) for x, _ in protect(DataLoader(data, batch_size=8, drop_last=True), MixUp(k=4))] == [8]
    assert [len(x) for x, _ in protect(DataLoader(data, batch_size=6), MixUp(k=4))] == [6, 4]
    public = torch.rand(5, 1, 4, 4)  # inter mode mixes with public images: any batch size will do
    inter = InstaHide(k=4, mode="inter", public=public)
    assert [len(x) for x, _ in protect(DataLoader(data, batch_size=3), inter)] == [3, 3, 3, 1]


def test_inter_instahide_public_file_errors_are_one_line(tmp_path):
    import numpy as np

    text = tmp_path / "notes.txt"
    text.write_text("not an npz\n")
    obj = np.empty(2, dtype=object)
    obj[:] = [np.zeros((8, 8, 3)), np.zeros((8, 8, 3))]
    np.savez(tmp_path / "obj.npz", x=obj)
    np.savez(tmp_path / "nox.npz", images=np.zeros((4, 8, 8, 3), dtype=np.uint8))
    for path, says in ((tmp_path / "missing.npz", "file not found"), (text, "not an npz"),
                       (tmp_path / "obj.npz", "not an npz"), (tmp_path / "nox.npz", "no array 'x'")):
        with pytest.raises(ConfigError) as err:
            InstaHide(k=4, mode="inter", public=str(path))
        assert str(err.value).startswith("instahide.public:") and says in str(err.value) and "\n" not in str(err.value)
