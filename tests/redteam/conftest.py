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
    this process (tests watch attacks here, and spawning workers costs seconds per run). The worker path
    has its own tests (test_workers.py), which ask for workers explicitly."""
    monkeypatch.setattr("guardfl.redteam.certification.run.default_workers", lambda device: 1)


def _watched(on_run) -> dict[str, type]:
    """The registry's attacks, each calling ``on_run(name)`` as it is built to run (with a device; planning
    and config validation build attacks without one): a mapping for ``certify(..., attacks=...)``."""
    from guardfl.redteam.attacks import ATTACKS

    def watch(cls: type) -> type:
        def __init__(self, **budget):
            if "device" in budget:
                on_run(cls.name)
            cls.__init__(self, **budget)

        return type(cls.__name__, (cls,), {"__init__": __init__, "__qualname__": cls.__qualname__,
                                           "__module__": cls.__module__})

    return {name: watch(cls) for name, cls in ATTACKS.items()}


@pytest.fixture
def kill_attack_at():
    """``attacks = kill_attack_at(k)``: with ``certify(..., attacks=attacks)``, the run is killed
    (KeyboardInterrupt) as its k-th attack job starts."""

    def arm(k: int) -> dict[str, type]:
        calls = []

        def on_run(name):
            calls.append(name)
            if len(calls) == k:
                raise KeyboardInterrupt

        return _watched(on_run)

    return arm


@pytest.fixture
def count_attack_runs(monkeypatch):
    """``calls = count_attack_runs()``: from then on, the name of every attack built to run is appended to
    ``calls``; the registry's entries are watched, so that runs through the CLI count too."""
    from guardfl.redteam.attacks import ATTACKS

    def arm() -> list[str]:
        calls = []
        for name, cls in _watched(calls.append).items():
            monkeypatch.setitem(ATTACKS, name, cls)
        return calls

    return arm
