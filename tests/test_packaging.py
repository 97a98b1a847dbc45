"""The wheel installs integrations/ and redteam/ under the guardfl namespace and nothing generic."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(ROOT)],
        check=True,
        capture_output=True,
    )
    (whl,) = out.glob("guardfl-*.whl")
    return whl


def test_wheel_holds_only_the_guardfl_namespace(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"guardfl", wheel.name.split("-")[0] + "-" + wheel.name.split("-")[1] + ".dist-info"}
    assert "guardfl/integrations/__init__.py" in names
    assert "guardfl/redteam/__init__.py" in names
    assert not any(n.startswith(("tests/", "bench/", "integrations/", "redteam/")) for n in names)
    entry = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "guardfl = guardfl.cli:main" in entry


def test_imports_from_the_installed_wheel_outside_the_repo(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        check=True,
        capture_output=True,
    )
    code = (
        "import guardfl, guardfl.integrations, guardfl.redteam, importlib, importlib.util, sys;"
        "import guardfl.integrations.torch, guardfl.integrations.update, guardfl.redteam.client.target;"
        "assert guardfl.integrations.torch.__file__.startswith(sys.argv[1]);"
        "assert importlib.util.find_spec('flwr') is None or importlib.import_module('guardfl.integrations.flower');"
        "assert guardfl.__file__.startswith(sys.argv[1]), guardfl.__file__;"
        "assert guardfl.integrations.__file__.startswith(sys.argv[1]);"
        "assert guardfl.redteam.__file__.startswith(sys.argv[1]);"
        "assert importlib.util.find_spec('integrations') is None;"
        "assert importlib.util.find_spec('redteam') is None;"
        "print('ok')"
    )
    run = subprocess.run(
        [sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(target)!r}); " + code, str(target)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "ok"
