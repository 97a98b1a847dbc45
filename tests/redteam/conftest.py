import pytest
import skimage.data
import torch

from guardfl.redteam.modality.image.models import LeNetZhu, wide_init_


@pytest.fixture(scope="session")
def faces():
    """Real images that need no download: the LFW subset shipped with scikit-image (25x25 grey)."""
    return torch.from_numpy(skimage.data.lfw_subset()[:100]).float().unsqueeze(1)


@pytest.fixture
def wide_lenet():
    torch.manual_seed(0)
    return wide_init_(LeNetZhu((1, 25, 25), 10))


@pytest.fixture(autouse=True)
def _sequential_cli(monkeypatch):
    """The CLI's default is one worker process per core; tests that go through the CLI run their jobs in
    this process (tests patch attacks here, and spawning workers costs seconds per run). The worker path
    has its own tests (test_workers.py), which ask for workers explicitly."""
    monkeypatch.setattr("guardfl.redteam.certification.certify.default_workers", lambda device: 1)


@pytest.fixture
def kill_attack_at(monkeypatch):
    """``kill_attack_at(k)``: the run is killed (KeyboardInterrupt) as its k-th attack job starts (config
    validation builds attacks without a device and does not count). Returns a function that puts the real
    attack registry back."""
    from guardfl.redteam.certification import certify as certify_mod

    real_get = certify_mod.attack_registry.get

    def arm(k: int):
        calls = []

        def get(name, **budget):
            if "device" in budget:
                calls.append(name)
                if len(calls) == k:
                    raise KeyboardInterrupt
            return real_get(name, **budget)

        monkeypatch.setattr(certify_mod.attack_registry, "get", get)
        return lambda: monkeypatch.setattr(certify_mod.attack_registry, "get", real_get)

    return arm


@pytest.fixture
def count_attack_runs(monkeypatch):
    """``calls = count_attack_runs()``: from then on, the name of every attack built to run (with a device;
    config validation builds attacks without one) is appended to ``calls``."""
    from guardfl.redteam.certification import certify as certify_mod

    def arm() -> list[str]:
        calls, real_get = [], certify_mod.attack_registry.get

        def counting(name, **budget):
            if "device" in budget:
                calls.append(name)
            return real_get(name, **budget)

        monkeypatch.setattr(certify_mod.attack_registry, "get", counting)
        return calls

    return arm
