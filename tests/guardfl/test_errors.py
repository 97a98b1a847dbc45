"""One error hierarchy: every exception class guardfl defines derives from ``GuardflError``."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

from guardfl.data import DataError
from guardfl.errors import GuardflError

PACKAGES = ("guardfl", "guardfl.redteam", "guardfl.integrations")

#: not errors: signals and control flow that never leave the function that raises them
NOT_ERRORS = {
    "guardfl.redteam.cli.common.Terminated": "SIGTERM, handled as Ctrl-C: a KeyboardInterrupt, so `except Exception` must not catch it",
    "guardfl.ops.representation._Captured": "stops a forward pass at a hook; caught in the same function",
    "guardfl.redteam.attacks.analytic.cocktail_party._Stop": "stops a forward pass at a hook; caught in the same function",
    "guardfl.redteam.attacks.malicious.fishing._OutOfQueries": "ends a query loop; caught in the same function",
}


def _modules() -> list[str]:
    names = set()
    for pkg in PACKAGES:
        module = importlib.import_module(pkg)
        names |= {m.name for m in pkgutil.walk_packages(module.__path__, pkg + ".")}
    return sorted(n for n in names if not n.endswith("__main__"))  # __main__ runs the command


def _exception_classes() -> dict[str, type]:
    found = {}
    for name in _modules():
        module = importlib.import_module(name)
        for obj in vars(module).values():
            if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == module.__name__:
                found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return found


def test_every_exception_class_derives_from_guardfl_error():
    found = _exception_classes()
    assert len(found) > 10 and "guardfl.data.DataError" in found  # the walk reached the red team and the core
    outside = sorted(name for name, cls in found.items() if not issubclass(cls, GuardflError) and name not in NOT_ERRORS)
    assert outside == [], f"exception classes outside GuardflError: {outside}"
    assert set(NOT_ERRORS) <= set(found), "an exempted class no longer exists: drop it from NOT_ERRORS"


def test_data_error_is_a_guardfl_error_and_still_a_value_error():
    with pytest.raises(GuardflError):
        raise DataError("data.path: npz file not found: 'x.npz'")
    assert issubclass(DataError, ValueError)  # callers that catch ValueError keep catching it
    from guardfl.redteam.modality.image import data

    assert data.DataError is DataError
