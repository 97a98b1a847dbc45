import os

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=True,
)
settings.register_profile("dev", max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

torch.set_num_threads(min(2, torch.get_num_threads()))


def pytest_collection_modifyitems(config, items):
    """Heavy tests run only when asked for with ``-m heavy``."""
    if "heavy" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="heavy: opt in with -m heavy")
    for item in items:
        if "heavy" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def small_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 5)
    )


@pytest.fixture
def small_batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(6, 1, 8, 8, generator=g), torch.randint(0, 5, (6,), generator=g)
