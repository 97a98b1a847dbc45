"""inspect_model's opt-in absolute leak limit (``leak_limit``): the client refuses any model, the honest one
included, with which a server reads more than k samples of its batch from the update's linear layers."""

import pytest
import torch
from torch import nn

from guardfl import inspect as I
from guardfl.errors import ConfigError
from guardfl.inspect import inspect_model, isolated_samples
from guardfl.redteam.attacks import get
from guardfl.redteam.client.simulate import FedSGD, simulate_client
from guardfl.redteam.modality.image.models import FC2, FC2BN, FC2GN, FC2LN
from guardfl.redteam.threat import ThreatModel


def bright(n=32, seed=0):
    """Inputs in [0, 1] that share most of their structure: the honest FC-2's units fire for a few samples."""
    g = torch.Generator().manual_seed(seed)
    return 0.8 + 0.2 * torch.rand(n, 3, 32, 32, generator=g), torch.arange(n) % 10


def centred(n=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(n, 3, 32, 32, generator=g) - 0.5) / 0.29, torch.arange(n) % 10


def test_the_honest_model_passes_the_isolation_check_and_is_refused_by_the_limit():
    """The honest FC-2 on bright inputs gives samples away by itself: the relative isolation check passes it
    (its fresh initialisation does the same), the absolute limit refuses it, naming the layer and the count."""
    torch.manual_seed(0)
    honest = FC2()
    batch = bright()
    plain = inspect_model(honest, honest, batch=batch)
    read = plain.checks["isolation"]["samples_read"]
    assert plain.ok and len(read) >= 4
    limited = inspect_model(honest, honest, batch=batch, leak_limit=0)
    assert not limited.ok and len(limited.reasons) == 1
    assert limited.reasons[0].startswith(f"leak limit: a server reads {len(read)} of the batch's 32 samples")
    assert "'net.1'" in limited.reasons[0] and "leak_limit = 0" in limited.reasons[0]
    assert limited.checks["leak_limit"]["read"] == len(read) and limited.checks["leak_limit"]["samples"] == read
    at = inspect_model(honest, honest, batch=batch, leak_limit=len(read))
    assert at.ok and at.checks["leak_limit"]["read"] == len(read)
    with pytest.raises(I.MaliciousModelError, match="leak limit"):
        inspect_model(honest, honest, batch=batch, leak_limit=len(read) - 1, strict=True)


def test_a_centred_batch_gives_nothing_away_and_passes_a_limit_of_zero():
    torch.manual_seed(0)
    honest = FC2()
    result = inspect_model(honest, honest, batch=centred(), leak_limit=0)
    assert result.ok and result.checks["leak_limit"]["read"] == 0


def test_the_count_bounds_what_exclusive_neurons_reads_on_a_wide_layer():
    """The honest server's cascade (exclusive units, checked, peeled from every unit) reads a wide layer's
    whole batch; the count peels with every row's support too, so it counts at least that (it stopped at
    separable sets of up to 5 samples, and counted 55-59 of 64 CIFAR-10 images that the attack read whole)."""
    torch.manual_seed(1)
    model = FC2(hidden=1024)
    x, y = bright(24, seed=3)
    obs = simulate_client(model, x, y, None, FedSGD())
    rec = get("exclusive_neurons").reconstruct(obs, ThreatModel(labels="known", defense="known"))
    checked = rec.info["checked"]
    close = (rec.inputs[:checked].flatten(1)[:, None] - x.flatten(1)[None]).abs().amax(2)
    read = {int(i) for i in close.argmin(1)}
    counted = set(inspect_model(model, model, batch=(x, y), leak_limit=64).checks["leak_limit"]["samples"])
    assert checked >= 4 and read <= counted


def test_peeling_reads_the_last_sample_of_any_row():
    """A unit of six samples of which five are read alone (each by its own unit) gives the sixth: the count
    peels whole rows' supports, past the separable sets' five."""
    delta = torch.zeros(6, 6, dtype=torch.float64)
    delta[:, 0] = torch.arange(1.0, 7.0)
    for n in range(5):
        delta[n, n + 1] = 1.0
    found, info = isolated_samples(delta)
    assert found == list(range(6)) and info["by_pairs"] == 6 and info["single_rows"] == 5


@pytest.mark.parametrize("make", [FC2BN, FC2GN, FC2LN])
def test_a_normalised_linear_layer_is_refused_under_a_limit(make):
    """Behind a normalisation a server undoes it with terms estimated on its own data, reading samples the
    count does not see (trap_weights through BatchNorm and GroupNorm): under a limit such a model is
    refused, the honest one too, with the reason; without a limit the honest one passes."""
    torch.manual_seed(0)
    honest = make()
    batch = centred()
    assert inspect_model(honest, honest, batch=batch).ok
    result = inspect_model(honest, honest, batch=batch, leak_limit=32)
    assert not result.ok and result.reasons == [
        f"leak limit: 'net.1 -> net.2' normalises a linear layer's output ({type(honest.net[2]).__name__}), behind which "
        f"the count is no bound (trap_weights reads faces exactly through BatchNorm and GroupNorm where it counts fewer): "
        f"the limit is not vouched for, refused"]


def test_a_layer_past_what_isolation_examines_is_refused_under_a_limit(monkeypatch):
    monkeypatch.setattr(I, "ISOLATION_MAX_UNITS", 128)
    torch.manual_seed(0)
    honest = FC2()
    result = inspect_model(honest, honest, batch=centred(), leak_limit=5)
    assert not result.ok and result.reasons == [
        "leak limit: layer net.1 (256 units > 128) is past what the isolation check examines: the limit is not vouched for, refused"]


def test_a_model_the_count_cannot_run_on_is_refused_under_a_limit():
    """A model without an nn.Linear layer: nothing counted, so nothing vouched for."""
    conv = nn.Sequential(nn.Conv2d(3, 10, 32), nn.Flatten())
    assert inspect_model(conv, conv, batch=centred()).ok
    result = inspect_model(conv, conv, batch=centred(), leak_limit=3)
    assert not result.ok and result.reasons[0].startswith("leak limit: what a server reads of the batch could not be counted")
    assert "skipped" in result.checks["leak_limit"]


@pytest.mark.parametrize("bad", [-1, True, 1.5, "2"])
def test_a_bad_limit_is_one_line_naming_it(bad):
    torch.manual_seed(0)
    honest = FC2()
    with pytest.raises(ConfigError, match=r"^leak_limit: expected None or an integer >= 0"):
        inspect_model(honest, honest, batch=centred(), leak_limit=bad)


def test_a_limit_needs_the_batch():
    torch.manual_seed(0)
    honest = FC2()
    with pytest.raises(ConfigError, match=r"^leak_limit: needs batch"):
        inspect_model(honest, honest, leak_limit=0)
