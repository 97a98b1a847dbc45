"""The red-team processes' allocator setting: page faults of a reused working set, and who decides."""

import os
import platform
import subprocess
import sys

import pytest

# three 30 MiB blocks allocated, written and freed, 10 times after 5 warm-up rounds: the page faults of the
# last 10 rounds (a working set an attack reuses every iteration)
SCRIPT = """
import resource, sys
import numpy as np
from guardfl.redteam.runtime.allocator import tune_malloc
state = tune_malloc() if sys.argv[1] == "tune" else "untouched"
def round_():
    a, b, c = (np.ones(30 << 18, np.float32) for _ in range(3))
    del a, b, c
for _ in range(5):
    round_()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    round_()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(state)
"""

glibc = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")


def _run(mode: str, **env: str) -> tuple[int, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES", "GUARDFL_MALLOC"))}
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], env={**clean, **env}, capture_output=True, text=True,
                         check=True, timeout=120).stdout.split("\n")
    return int(out[0]), out[1]


@glibc
def test_tuned_process_reuses_its_working_set_without_page_faults():
    faults, state = _run("tune")
    assert state.startswith("glibc: mmap threshold 32 MiB")
    assert faults < 500  # ~0 measured; each round touches 23,040 pages
    untouched, _ = _run("none")
    assert untouched > 5_000  # glibc's defaults give the heap top back and fault it in again (~15,000)


@glibc
@pytest.mark.parametrize("env, says", [({"GUARDFL_MALLOC": "default"}, "GUARDFL_MALLOC=default"),
                                       ({"MALLOC_ARENA_MAX": "2", "MALLOC_TRIM_THRESHOLD_": "1000000"}, "the user's (MALLOC_TRIM_THRESHOLD_)"),
                                       ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1000000"}, "the user's (GLIBC_TUNABLES)")])
def test_the_users_allocator_settings_are_kept(env, says):
    faults, state = _run("tune", **env)
    assert says in state


def test_importing_guardfl_leaves_the_allocator_alone():
    """Only the commands (and the worker processes they spawn) tune it: a library never retunes its host."""
    code = "import guardfl, guardfl.redteam.certification.certify, guardfl.redteam.sweep.run; from guardfl.redteam.runtime import allocator; print(allocator.state())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120).stdout
    assert out.strip() == "untouched"
