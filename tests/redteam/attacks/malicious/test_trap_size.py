"""How large a trap the client's known defense lets through (``trap_size``): pure functions of the defense's
configuration and the first layer's geometry (FC-2 on 25 x 25 faces: 256 x 625)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from guardfl.ops.selection import prune_count
from guardfl.redteam.attacks import get
from guardfl.redteam.attacks.malicious.trap_size import AUTO_ROWS, auto_rows, kept_rows

U, D = 256, 625


def gradprune(ratio, scope="layer"):
    return {"kind": "gradprune", "ratio": ratio, "scope": scope}


def test_per_layer_pruning_keeps_as_many_whole_rows_as_its_weight_and_bias_keep():
    assert kept_rows(gradprune(0.99), U, D, 0) == 2  # 1,600 weight entries: 2 rows of 625; 3 bias entries
    assert kept_rows(gradprune(0.9), U, D, 0) == 25
    assert kept_rows({"kind": "outpost"}, U, D, 0) == 51  # Outpost prunes 80% of each layer by default


def test_global_pruning_keeps_its_share_of_every_parameter_and_stages_bind_by_the_smallest():
    parameters = U * D + U + 10 * U + 10
    assert kept_rows(gradprune(0.99, "global"), U, D, parameters) == (parameters - prune_count(0.99, parameters)) // (D + 1)
    stack = {"kind": "stack", "defenses": [gradprune(0.9), {"kind": "sign"}, gradprune(0.99)]}
    assert kept_rows(stack, U, D, 0) == 2


def test_defenses_that_do_not_prune_keep_every_row():
    for config in (None, {"kind": "sign"}, {"kind": "gaussian", "sigma": 0.01},
                   {"kind": "dpsgd", "noise_multiplier": 1.0, "max_grad_norm": 1.0},
                   {"kind": "outpost", "prune": 0.0, "noise": 0.8, "phi": 0.4}):
        assert kept_rows(config, U, D, 0) is None
    assert auto_rows(None, U, D, 0, 3, "top")[:2] == (3, AUTO_ROWS)


def test_auto_fits_the_trap_in_what_the_pruning_keeps_and_keeps_a_bin():
    assert auto_rows(gradprune(0.99), U, D, 0, 1, "middle")[:2] == (1, 2)  # 2 rows around the median: one bin
    assert auto_rows(gradprune(0.99), U, D, 0, 4, "top")[:2] == (2, 1)  # 2 single rows, each a bin at the top
    assert auto_rows(gradprune(0.9), U, D, 0, 1, "middle")[:2] == (1, AUTO_ROWS)
    assert auto_rows(gradprune(0.9), U, D, 0, 8, "top")[:2] == (8, 3)
    chains, rows, line = auto_rows(gradprune(0.999), U, D, 0, 1, "middle")
    assert (chains, rows) == (1, 2) and "not all whole" in line  # nothing fits: the fewest rows that make a bin


@settings(max_examples=60, deadline=None)
@given(ratio=st.floats(0.5, 0.999), chains=st.integers(1, 16), middle=st.booleans())
def test_auto_never_asks_for_more_rows_than_the_pruning_keeps_unless_no_bin_would_fit(ratio, chains, middle):
    least = 2 if middle else 1
    kept = kept_rows(gradprune(ratio), U, D, 0)
    fitted, rows, _ = auto_rows(gradprune(ratio), U, D, 0, chains, "middle" if middle else "top")
    assert 1 <= fitted <= chains and least <= rows <= AUTO_ROWS
    assert fitted * rows <= kept or (fitted == 1 and rows == least > kept)


def test_bad_rows_are_one_line_naming_the_field():
    for bad in ("many", 0, True, 2.5, 70000):
        with pytest.raises(ValueError, match=r"rows: expected null, 'auto', 'fit' or an integer in \[1, 65536\]"):
            get("trap_weights", rows=bad)
    assert get("trap_weights", rows="auto", cuts="middle").config.rows == "auto"
    assert get("trap_weights", rows="fit").config.rows == "fit"
