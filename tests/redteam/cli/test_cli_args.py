"""The red-team command's argument types (redteam/cli/common.py; named apart from tests/guardfl/test_cli.py: test modules need unique basenames)."""

from __future__ import annotations

import argparse

import pytest

from guardfl.redteam.certification.plan import max_threads
from guardfl.redteam.cli.common import positive_int


def test_positive_int_takes_integers_from_one_and_bounded_ones_up_to_max_threads():
    assert positive_int("--samples")("3") == 3
    assert positive_int("--workers", bounded=True)(str(max_threads())) == max_threads()
    for bad in ("0", "-1", "x", "1.5"):
        with pytest.raises(argparse.ArgumentTypeError, match=r"^--samples: expected an integer >= 1"):
            positive_int("--samples")(bad)
    with pytest.raises(argparse.ArgumentTypeError, match=rf"^--threads: expected an integer in \[1, {max_threads()}\]"):
        positive_int("--threads", bounded=True)(str(max_threads() + 1))
