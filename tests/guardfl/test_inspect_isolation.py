"""inspect_model's isolation check (issue 34): the samples a server reads exactly from one or two rows of a
linear layer's weight gradient, counted on the client's batch and judged against the client's own model."""

import copy

import pytest
import torch
from torch import nn
from hypothesis import given, settings
from hypothesis import strategies as st

from guardfl.inspect import inspect_model, isolated_samples, isolation_limit, kept_at_fresh_init
from guardfl.redteam.attacks.malicious.trap_chain import auto_rho, disguise
from guardfl.redteam.attacks.malicious.trap_weights import craft, trap_layers
from guardfl.redteam.modality.image.models import FC2


def chain_delta(batch=16, bins=12, seed=0):
    """Coefficients of a Robbing-the-Fed chain: row i holds the samples above cut-off i, each with its
    sample's shared coefficient D_n (batch x rows)."""
    g = torch.Generator().manual_seed(seed)
    s = torch.rand(batch, generator=g, dtype=torch.float64)
    cuts = torch.linspace(-0.1, 0.95, bins, dtype=torch.float64)
    d = torch.randn(batch, generator=g, dtype=torch.float64)
    return (s[:, None] > cuts[None, :]).double() * d[:, None], s, cuts


def test_a_chain_of_bins_isolates_every_sample_alone_in_its_bin():
    delta, s, cuts = chain_delta()
    found, info = isolated_samples(delta)
    bins = torch.bucketize(s, cuts)
    alone = [n for n in range(len(s)) if int((bins == bins[n]).sum()) == 1]
    assert set(alone) <= set(found) and info["separating_pairs"] >= len(alone) - 1


def test_peeling_reads_a_bin_of_two_once_one_of_them_is_read():
    # samples x rows: row 0 holds {0, 1, 2}, row 1 {1, 2}, row 2 {2}, with proportional coefficients
    delta = torch.tensor([[1.0, 0.0, 0.0], [1.0, 2.0, 0.0], [1.0, 2.0, 3.0]])
    found, _ = isolated_samples(delta)
    assert found == [0, 1, 2]
    two = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 0.0]])  # row 0 holds {0,1,2}, row 1 holds {0} alone
    found, _ = isolated_samples(two)
    assert found == [0]  # {1, 2} stay mixed: nothing separates them


def test_coefficients_that_do_not_cancel_separate_nothing():
    delta = torch.zeros(3, 2)
    delta[:, 0] = torch.tensor([1.0, 3.0, -2.0])  # row 0 holds every sample
    delta[:, 1] = torch.tensor([0.0, 1.0, 0.0])   # row 1 holds sample 1 alone
    found, info = isolated_samples(delta)
    assert found == [1] and info["single_rows"] == 1
    nested = torch.tensor([[1.0, 1.0], [1.0, 0.0], [2.0, 7.0]])  # row 1 = {0, 2} inside row 0 = {0,1,2}: not proportional
    found, info = isolated_samples(nested)
    assert found == [] and info["nested_pairs"] == 1 and info["separating_pairs"] == 0


@settings(deadline=None, max_examples=30)
@given(st.integers(0, 2**16), st.floats(0.1, 10.0))
def test_the_count_ignores_row_order_and_row_scale(seed, scale):
    delta, _, _ = chain_delta(seed=seed)
    found, _ = isolated_samples(delta)
    perm = torch.randperm(delta.shape[1], generator=torch.Generator().manual_seed(seed))
    scaled = delta[:, perm] * torch.linspace(scale, 1.0, delta.shape[1], dtype=torch.float64)
    assert isolated_samples(scaled)[0] == found


@settings(deadline=None, max_examples=30)
@given(st.integers(0, 2**16))
def test_dense_random_coefficients_isolate_nothing(seed):
    g = torch.Generator().manual_seed(seed)
    delta = torch.randn(32, 64, generator=g) * (torch.rand(32, 64, generator=g) < 0.5)
    assert isolated_samples(delta)[0] == []


def cifar_like(n=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, 3, 32, 32, generator=g), torch.arange(n) % 10


def trapped(model, rows=None, chains=2, seed=0, disguised=True, column_noise=0.0):
    """Trap weights in ``model``; ``disguised``: each chain row with a part the inputs barely see (the red
    team's answer to the near-parallel-rows check, ``trap_weights disguise``); ``column_noise``: the chain's
    shared classifier column varied per row (its answer to the shared-columns check)."""
    layers = trap_layers(model, (3, 32, 32))
    x, _ = cifar_like(512, seed=99)
    gen = torch.Generator().manual_seed(seed)
    trap = craft(model, layers, (3, 32, 32), x, chains, column_noise, (0.0, 1.0), gen, rows, 32)
    if disguised:
        disguise(trap.rows(), auto_rho(), (3, 32, 32), x, gen)
    return trap.sent


def test_trap_weights_pass_every_weight_check_and_fail_the_batch_check():
    torch.manual_seed(0)
    honest = FC2()
    plain = inspect_model(trapped(honest, disguised=False).state_dict(), honest)
    assert [r.split(":")[0] for r in plain.reasons] == ["parallel rows"]  # a chain's rows: one direction
    sent = trapped(honest)
    assert inspect_model(sent.state_dict(), honest).ok  # weights alone: the disguise holds
    result = inspect_model(sent.state_dict(), honest, batch=centred())
    assert not result.ok and any(r.startswith("isolation: layer 'net.1'") for r in result.reasons)
    assert result.checks["isolation"]["baseline"]["net.1"] == 0  # the honest architecture isolates none of them
    assert result.checks["isolation"]["rule"].startswith("flagged at >= max(2, 5% of the batch)")


def centred(n=32, seed=0):
    """``cifar_like`` centred and scaled as a normalising transform leaves images: the honest MLP's units
    then fire for about half the batch each and isolate no sample."""
    x, y = cifar_like(n, seed)
    return (x - 0.5) / 0.29, y


def test_on_uncentred_inputs_only_an_excess_beyond_chance_is_judged():
    """On inputs in [0, 1] the honest architecture at a fresh initialisation singles out half of the batch
    by itself, and draws of it differ by a dozen: the whole-layer trap's 32 of 32 is within chance there,
    and the shared-columns check is what refuses it (a count cannot separate it from the honest leak)."""
    torch.manual_seed(0)
    honest = FC2()
    result = inspect_model(trapped(honest).state_dict(), honest, batch=cifar_like())
    base = result.checks["isolation"]["baseline"]["net.1"]
    assert base >= 8 and result.checks["isolation"]["layers"]["net.1"]["isolated"] == 32
    assert isolation_limit(32, base) > 32 and not any(r.startswith("isolation") for r in result.reasons)
    assert [r.split(":")[0] for r in result.reasons] == ["shared columns"]


def test_the_baseline_is_the_clients_own_fresh_initialisation_never_the_servers_weights():
    """In Flower the reference is the client's model after the previous round, which the server sent: a
    count judged against it could be ratcheted up a few samples per round. The baseline is a fresh
    initialisation of the reference's architecture (a fixed seed, the global RNG untouched)."""
    torch.manual_seed(0)
    honest = FC2()
    sent = trapped(honest, disguised=False)
    state = torch.random.get_rng_state()
    against_honest = inspect_model(sent.state_dict(), honest, batch=centred())
    against_trap = inspect_model(sent.state_dict(), copy.deepcopy(sent), batch=centred())
    assert torch.equal(state, torch.random.get_rng_state())
    assert against_honest.checks["isolation"]["baseline"] == against_trap.checks["isolation"]["baseline"]
    assert any(r.startswith("isolation") for r in against_trap.reasons)


def test_a_reference_that_cannot_be_re_initialised_is_the_baseline_itself_and_checks_say_so():
    """Fail closed: where no fresh copy of the architecture can be made (here the reference refuses to be
    copied; the received model is passed as a module, which needs no copy of it), the counts are judged
    against the reference's own weights, not left unjudged."""
    class Uncopyable(FC2):
        def __deepcopy__(self, memo):
            raise RuntimeError("no copies")

    torch.manual_seed(0)
    honest = Uncopyable()
    sent = trapped(FC2(), column_noise=0.1)
    result = inspect_model(sent, honest, batch=centred())
    assert result.checks["isolation"]["baseline_model"].startswith("the reference's own weights")
    assert [r.split(":")[0] for r in result.reasons] == ["isolation"]
    fresh = inspect_model(sent.state_dict(), FC2(), batch=centred())
    assert fresh.checks["isolation"]["baseline_model"] == "a fresh initialisation (seed 0)"


def test_the_limit_is_the_threshold_where_the_architecture_isolates_fewer_and_beyond_chance_otherwise():
    assert isolation_limit(64, 0) == isolation_limit(64, 3) == 0.05 * 64 and isolation_limit(16, 1) == 2
    for n, base in ((32, 17), (64, 23), (64, 4)):
        p = base / n
        assert isolation_limit(n, base) == pytest.approx(base + max(2, 0.05 * n) + 5 * (n * p * (1 - p)) ** 0.5)


def test_a_read_within_a_quarter_of_the_input_counts_where_the_coefficients_do_not_cancel():
    """Row 0 holds samples {0, 1, 2}, row 1 {1, 2}, their coefficients 20% apart on sample 1 (over the
    coefficients' 10% tolerance), but samples 1 and 2 are alike and much dimmer than sample 0: the read of
    sample 0 from row 0 - c row 1 is within 0.25 of it. Without the inputs the pair does not count."""
    delta = torch.tensor([[1.0, 0.0], [1.2, 1.0], [1.0, 1.0]], dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    a = torch.rand(3, 50, generator=g, dtype=torch.float64)
    a[2] = a[1] + 0.01 * torch.randn(50, generator=g, dtype=torch.float64)
    a[1:] *= 0.3
    assert isolated_samples(delta)[0] == []
    found, info = isolated_samples(delta, a)
    assert found == [0] and info["separating_pairs"] == 1
    a[2] = -a[1]  # unlike: the residual reads as sample 1's input, 1.5 times sample 0's norm over 0.25
    a[0] *= 0.2
    assert isolated_samples(delta, a)[0] == []


def test_a_row_dominated_by_one_sample_reads_it():
    """A row of two samples whose other sample's contribution is under a quarter of the first's reads the
    first, and the second is then peeled from the row that holds both (its read off by the first's error,
    a tenth)."""
    delta = torch.tensor([[1.0, 1.0], [0.1, 1.0]], dtype=torch.float64)
    a = torch.eye(2, 8, dtype=torch.float64)
    found, info = isolated_samples(delta, a)
    assert info["dominated_rows"] == 1 and found == [0, 1] and info["by_pairs"] == 2
    delta[1, 0] = 0.5
    assert isolated_samples(delta, a)[0] == []


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_honest_models_pass_on_centred_and_uncentred_inputs(seed):
    torch.manual_seed(seed)
    honest = FC2()
    for batch in (cifar_like(), centred()):
        result = inspect_model(honest.state_dict(), copy.deepcopy(honest), batch=batch)
        assert result.ok, result.reasons


def test_uncentred_inputs_isolate_samples_in_an_honest_mlp_and_that_is_no_reason():
    """FC-2 at PyTorch's default init on inputs that share most of their structure (all bright): sparse
    units fire for one or two samples. A real leak of the honest architecture (the honest-server attacks
    measure it), not a malicious edit: judged against a fresh initialisation of the architecture (the
    reference's, or the received module's without one), it is within chance."""
    x = 0.8 + 0.2 * cifar_like()[0]
    batch = (x, torch.arange(32) % 10)
    counts = []
    for seed in range(5):  # draws of the honest model single out 3 to 18 of these 32 samples
        torch.manual_seed(seed)
        honest = FC2()
        with_ref = inspect_model(honest.state_dict(), copy.deepcopy(honest), batch=batch)
        alone = inspect_model(honest, batch=batch)
        assert with_ref.ok and alone.ok
        assert alone.checks["isolation"]["baseline"] == with_ref.checks["isolation"]["baseline"]
        counts.append(alone.checks["isolation"]["max_isolated"])
    assert max(counts) >= 8 and max(counts) - min(counts) >= 8 and alone.checks["isolation"]["baseline"]["net.1"] >= 8


def test_a_small_trap_stays_under_the_check_that_counts_against_the_honest_model():
    """The construction that adapts to the isolation check (a handful of trapped rows): it passes, which
    is why the red team runs it (configs/research/malicious-adaptive-inspect.yaml does not certify). Its rows share
    one classifier column, which the shared-columns check refuses; with that column varied per row
    (``column_noise``) it passes every check."""
    torch.manual_seed(0)
    honest = FC2()
    shared = inspect_model(trapped(honest, rows=3, chains=1).state_dict(), honest, batch=cifar_like())
    assert [r.split(":")[0] for r in shared.reasons] == ["shared columns"]
    assert inspect_model(trapped(honest, rows=3, chains=1, column_noise=0.1).state_dict(), honest, batch=cifar_like()).ok


@pytest.mark.parametrize("units", [8, 64])
def test_isolation_is_reported_per_layer(units):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, units), torch.nn.ReLU(), torch.nn.Linear(units, 3))
    result = inspect_model(model, batch=(torch.randn(16, 12), torch.arange(16) % 3))
    assert set(result.checks["isolation"]["layers"]) == {"1", "3"} and result.ok


def _bins_behind_batchnorm(rows=64, features=12, seed=0):
    """Robbing the Fed's bins on a BatchNorm-normalised input: every row measures feature 0, with cut-offs
    at quantiles of N(0, 1), which is what that feature is after normalising with the batch's statistics.
    The server also sets the running variance huge, so in eval mode every sample normalises to ~0 and
    falls in one bin: the batch looks benign to a check that runs in eval mode."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.BatchNorm1d(features), torch.nn.Linear(features, rows),
                                torch.nn.ReLU(), torch.nn.Linear(rows, 3))
    with torch.no_grad():
        model[2].weight.zero_()
        model[2].weight[:, 0] = 1.0
        model[2].bias.copy_(-torch.distributions.Normal(0.0, 1.0).icdf(torch.linspace(0.02, 0.98, rows)))
        model[4].weight.copy_(model[4].weight[:, :1].expand(3, rows))  # shared classifier columns: bins subtract
        model[1].running_var.fill_(1e10)
    return model


def test_the_batch_checks_see_batchnorm_as_the_client_trains_it():
    """The client trains with the batch's statistics: the checks do too, so running statistics chosen to
    hide the bins in eval mode hide nothing, and the client's own buffers are left as they were."""
    model = _bins_behind_batchnorm()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(32, 12, generator=g), torch.arange(32) % 3)
    result = inspect_model(model, batch=batch)
    assert result.checks["isolation"]["layers"]["2"]["isolated"] >= 16  # most of the batch, one per bin
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()) and model.training
    model.eval()  # what the checks saw before: one bin for all, nothing isolated
    with torch.no_grad():
        assert int((model[:3](batch[0]) > 0).float().std(0).sum()) == 0


# -- behind a normalisation: the gradient at its output ----------------------------------------------------------
def test_a_normalisation_reading_a_linear_layer_is_examined_at_its_output():
    from guardfl.redteam.modality.image.models import FC2BN

    torch.manual_seed(0)
    for norm, key in ((torch.nn.BatchNorm1d(32), "1 -> 2"), (torch.nn.LayerNorm(32), "1 -> 2"), (torch.nn.GroupNorm(4, 32), "1 -> 2")):
        model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 32), norm, torch.nn.ReLU(), torch.nn.Linear(32, 3))
        result = inspect_model(model, copy.deepcopy(model), batch=(torch.randn(16, 12), torch.arange(16) % 3))
        assert set(result.checks["isolation"]["layers"]) == {"1", key, "4"} and result.ok, type(norm).__name__
    result = inspect_model(FC2BN(), FC2BN(), batch=cifar_like())
    assert set(result.checks["isolation"]["baseline"]) == {"net.1", "net.1 -> net.2", "net.4"}


def test_benign_batchnorm_mlps_are_never_flagged_against_an_earlier_model():
    """A BatchNorm MLP received after training or a FedAvg round, inspected against the client's earlier
    copy (not itself): no isolation excess at the linear layer or at BatchNorm's output (bench: 0 of 108
    inspections over three seeds, the worst excess 0)."""
    from guardfl.redteam.modality.image.models import FC2BN
    from tests import malicious as M

    if not M.CIFAR.exists():
        pytest.skip(f"needs the shared CIFAR-10 sample {M.CIFAR}")
    x, y = M.cifar(256)
    batches = [M.cifar(32, offset=4000), M.cifar(64, offset=4100), (M.cifar(32, offset=4200)[0], torch.full((32,), 3))]
    torch.manual_seed(0)
    start = FC2BN()
    trained = M.train(copy.deepcopy(start), x, y, epochs=2)
    (round1,) = M.fedavg(trained, x, y, clients=4, rounds=1)
    for received, reference in ((FC2BN(), start), (trained, start), (round1, trained)):
        for batch in batches:
            result = inspect_model(received, reference, batch=batch)
            assert result.ok, result.reasons


def test_a_view_between_the_linear_layer_and_its_batchnorm_hides_nothing():
    """A reshape in between makes BatchNorm read a new tensor: its output is examined all the same."""
    from guardfl.redteam.modality.image.models import FC2BN
    from tests.redteam.attacks.malicious.test_trap_weights import batch, setup_bn
    from guardfl.redteam.attacks import get
    from guardfl.redteam.client.simulate import ClientQuery, FedSGD

    bn, setting, threat = setup_bn()
    x, y = batch()
    sent = get("trap_weights", seed=0).interrogate(ClientQuery(x, y, None, FedSGD()), setting, threat).info["malicious_model"]
    viewed = copy.deepcopy(sent)
    viewed.net.insert(2, torch.nn.Sequential(torch.nn.Unflatten(1, (16, 16)), torch.nn.Flatten()))
    reference = FC2BN()
    reference.net.insert(2, torch.nn.Sequential(torch.nn.Unflatten(1, (16, 16)), torch.nn.Flatten()))
    found = inspect_model(viewed, reference, batch=(x, y))
    assert found.checks["isolation"]["layers"]["net.1 -> net.3"]["isolated"] >= 16 and not found.ok


class Shifted(nn.Module):
    """FC-2 behind a learnable input shift: a custom module's own ``nn.Parameter``, which no reset method
    covers."""

    def __init__(self):
        super().__init__()
        self.shift = nn.Parameter(torch.zeros(3, 32, 32))
        self.body = FC2()

    def forward(self, x):
        return self.body(x + self.shift)


def test_parameters_no_reset_covers_are_named_with_the_model_they_come_from():
    """The fresh initialisation keeps what no reset method covers, taken from the model the baseline is
    made of: named in checks, with the reference's or the server's (the received model's) as its source."""
    torch.manual_seed(0)
    model = Shifted()
    assert kept_at_fresh_init(model) == ["shift"]
    assert kept_at_fresh_init(FC2()) == []
    attention = nn.MultiheadAttention(16, 2)  # only the private _reset_parameters: torch.nn's own, called
    assert kept_at_fresh_init(attention) == []
    with_reference = inspect_model(model.state_dict(), Shifted(), batch=centred())
    assert "kept as they are in the reference, the client's: shift" in with_reference.checks["isolation"]["baseline_model"]
    alone = inspect_model(model, batch=centred())
    assert "the received model, the server's: shift" in alone.checks["isolation"]["baseline_model"]
    plain = inspect_model(FC2(), batch=centred())
    assert plain.checks["isolation"]["baseline_model"] == "a fresh initialisation (seed 0)"


def test_a_trap_in_a_layer_wider_than_4096_units_is_examined_and_refused():
    """Until 2026-11-27 isolation examined layers of at most 4,096 units: in FC-2 with 5,000 units it did not
    run. Now up to 8,192: a disguised trap (whole layer, 2 chains) isolates 30 of 32 centred samples there,
    the honest architecture none. (On a batch of 16 the honest layer itself singles out all 16: so many
    units that some fire for one sample alone, and the trap passes, as on any batch where the architecture
    leaks by itself.)"""
    torch.manual_seed(0)
    honest = FC2(hidden=5000)
    result = inspect_model(trapped(honest).state_dict(), honest, batch=centred())
    assert "not_examined" not in result.checks["isolation"]
    assert not result.ok and any(r.startswith("isolation: layer 'net.1'") for r in result.reasons), result.reasons


def test_a_layer_wider_than_the_limit_is_named_not_examined(monkeypatch):
    import guardfl.inspect as inspect_module

    monkeypatch.setattr(inspect_module, "ISOLATION_MAX_UNITS", 100)
    torch.manual_seed(0)
    model = FC2()
    result = inspect_model(model, model, batch=centred())
    assert result.checks["isolation"]["not_examined"] == ["net.1 (256 units > 100)"] and result.ok
