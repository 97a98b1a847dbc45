"""The documentation is tested like code (issue 67).

- The README stays short, keeps the fresh-machine commands CI greps for, and every ``python`` block in it
  runs against the current API (the Flower and NVFlare blocks are then driven: a train message through the
  ClientApp, the recipe's exported site config).
- The docstring examples of the public modules are doctests (``PUBLIC_MODULES``), run here.
- Every public function and class of ``guardfl``, ``guardfl.defenses``, ``guardfl.integrations`` and the red
  team's entry points has a docstring whose first line is a summary.
- ``mkdocs build --strict`` builds the site (skipped without the ``docs`` extra), and a broken link or a
  missing cross-reference fails it with the page and the link; the built index, the config reference and a
  tutorial open in headless Chromium with no console error (marker ``browser``, ``tests/browser.py``).
"""

from __future__ import annotations

import contextlib
import doctest
import functools
import http.server
import importlib
import importlib.util
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

#: the modules whose docstring examples are doctests, and whose public objects must be documented
PUBLIC_MODULES = [
    "guardfl", "guardfl.defenses", "guardfl.bounds", "guardfl.optimizer", "guardfl.protect", "guardfl.inspect",
    "guardfl.integrations", "guardfl.integrations.torch", "guardfl.integrations.round", "guardfl.integrations.update",
    "guardfl.integrations.flower", "guardfl.integrations.nvflare", "guardfl.redteam",
    "guardfl.redteam.certification.run", "guardfl.cli",
]


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def test_the_readme_is_a_screen_or_two_and_keeps_the_fresh_machine_commands():
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    assert ".venv/bin/python -m pytest" in text  # CI greps the README's test command
    assert ".venv/bin/guardfl redteam --config configs/default.yaml --out redteam-out" in text
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", text), "dated measurement logs belong in docs/research"
    for link in re.findall(r"\]\(((?:docs|configs)/[^)#]+)", text):
        assert (ROOT / link).exists(), f"README links to {link}, which does not exist"


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FLWR_TELEMETRY_ENABLED", "0")
    return tmp_path


def _block(marker: str) -> str:
    (block,) = [b for b in python_blocks(README.read_text()) if marker in b]
    return block


def test_the_readme_wrap_block_runs(in_tmp):
    exec(compile(_block("guardfl.wrap("), "README.md", "exec"), {})


def test_the_readme_flower_block_defines_a_clientapp_that_trains(in_tmp):
    pytest.importorskip("flwr")
    import torch
    from flwr.app import Context, RecordDict
    from torch.utils.data import DataLoader, TensorDataset

    from guardfl.integrations import flower as gf

    x, y = torch.rand(8, 1, 28, 28), torch.randint(0, 10, (8,))
    ns = {"my_loader": lambda context: DataLoader(TensorDataset(x, y), batch_size=4)}
    exec(compile(_block("ClientApp("), "README.md", "exec"), ns)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(28 * 28, 10))
    context = Context(run_id=1, node_id=1, node_config={"partition-id": 0}, state=RecordDict(), run_config={})
    reply = ns["app"](gf.train_message(model.state_dict()), context)
    assert not reply.has_error(), reply.error
    assert set(reply.content["arrays"].keys()) == set(model.state_dict())


def test_the_readme_nvflare_block_writes_the_filters_into_the_sites_config(in_tmp, monkeypatch):
    pytest.importorskip("nvflare")
    (in_tmp / "client.py").write_text("print('train')\n")
    # a small local module for the model class: NVFlare's Job API copies a model class's module into the job
    (in_tmp / "readme_task.py").write_text("import torch\n\nclass Net(torch.nn.Linear):\n"
                                           "    def __init__(self):\n        super().__init__(2, 2)\n")
    monkeypatch.syspath_prepend(str(in_tmp))
    from readme_task import Net

    ns = {"Net": Net}
    exec(compile(_block("add_update_filter("), "README.md", "exec"), ns)
    ns["recipe"].export(job_dir=str(in_tmp / "jobs"))
    (config,) = (in_tmp / "jobs").rglob("config_fed_client.json")
    written = json.loads(config.read_text())
    (result_filters,) = written["task_result_filters"]
    assert result_filters["filters"][0]["path"] == "guardfl.integrations.nvflare.GuardUpdateFilter"
    assert written["task_data_filters"][0]["filters"][0]["path"] == "guardfl.integrations.nvflare.InspectModelFilter"
    # the job-config JSON the README gives for an exported job is the one the filter writes
    shown = re.search(r"`(\{\"task_result_filters\".*?\})`", README.read_text()).group(1)
    assert json.loads(shown)["task_result_filters"][0]["filters"] == result_filters["filters"]


def test_the_readme_certify_block_certifies(in_tmp):
    ns: dict = {}
    exec(compile(_block("certify("), "README.md", "exec"), ns)
    cert = ns["cert"]
    assert cert.verdict in ("CERTIFIED", "NOT CERTIFIED", "INCONCLUSIVE")
    assert cert.bound["status"] == "NO MECHANISM"  # pruning is deterministic: no theorem
    assert (in_tmp / "redteam-out" / "certificate.json").is_file()


# -- the docs pages' code ------------------------------------------------------------------------------------

DOCS = ROOT / "docs"
#: pages whose python blocks run in order, in one namespace (``my_loader(context)``: the reader's data)
RUN_PAGES = ["tutorials/first-certificate.md", "tutorials/dpsgd-proven.md", "tutorials/flower-client.md"]


def docs_pages() -> list[Path]:
    return sorted(p for p in DOCS.rglob("*.md") if "research" not in p.parts)


@pytest.mark.parametrize("page", RUN_PAGES)
def test_the_tutorials_python_blocks_run(page, in_tmp):
    if "flower" in page:
        pytest.importorskip("flwr")
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    x, y = torch.rand(8, 1, 28, 28), torch.randint(0, 10, (8,))
    ns = {"my_loader": lambda context: DataLoader(TensorDataset(x, y), batch_size=4)}
    for block in python_blocks((DOCS / page).read_text()):
        exec(compile(block, page, "exec"), ns)


def _optional_and_absent(module: str) -> bool:
    """An optional framework (the ``flower`` / ``nvflare`` extras) this environment does not have."""
    top = module.split(".")[0]
    return top in ("flwr", "nvflare") and importlib.util.find_spec(top) is None


@pytest.mark.parametrize("page", [p.relative_to(DOCS).as_posix() for p in docs_pages()])
def test_every_python_block_of_the_docs_parses_and_imports_what_it_names(page):
    """Blocks that need a running framework (NVFlare's Client API, a Ray cluster) are not run; they must still
    parse, and every name they import must exist (a renamed API fails here)."""
    import ast

    for block in python_blocks((DOCS / page).read_text()):
        tree = ast.parse(block, page)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                if _optional_and_absent(node.module):
                    continue
                mod = importlib.import_module(node.module)
                for alias in node.names:
                    assert hasattr(mod, alias.name) or importlib.util.find_spec(f"{node.module}.{alias.name}"), \
                        f"{page}: from {node.module} import {alias.name}: no such name"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if _optional_and_absent(alias.name):
                        continue
                    importlib.import_module(alias.name)


# -- docstrings -------------------------------------------------------------------------------------------

def _doctests(module: str) -> list[doctest.DocTest]:
    mod = importlib.import_module(module)
    return [t for t in doctest.DocTestFinder(exclude_empty=True).find(mod, module) if t.examples]


@pytest.mark.parametrize("module", PUBLIC_MODULES)
def test_docstring_examples(module):
    if module.endswith(("flower",)):
        pytest.importorskip("flwr")
    if module.endswith("nvflare"):
        pytest.importorskip("nvflare")
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in _doctests(module):
        result = runner.run(test, out=lambda s: None)
        if result.failed:
            report: list[str] = []
            doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE).run(test, out=report.append)
            pytest.fail("".join(report))


def public_objects(module: str):
    mod = importlib.import_module(module)
    listed = getattr(mod, "__all__", None)
    names = listed or [n for n in vars(mod) if not n.startswith("_")]
    for name in names:
        obj = getattr(mod, name)
        if not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue
        if listed is None and getattr(obj, "__module__", None) != mod.__name__:
            continue  # imported into a module without __all__: documented where it is defined
        yield f"{module}.{name}", obj


@pytest.mark.parametrize("module", [m for m in PUBLIC_MODULES if m not in ("guardfl.cli",)])
def test_every_public_function_and_class_has_a_summary(module):
    if module.endswith("flower"):
        pytest.importorskip("flwr")
    if module.endswith("nvflare"):
        pytest.importorskip("nvflare")
    missing = []
    for name, obj in public_objects(module):
        doc = obj.__dict__.get("__doc__") if inspect.isclass(obj) else obj.__doc__
        first = (inspect.cleandoc(doc).splitlines() or [""])[0] if doc else ""
        if not first.strip():
            missing.append(name)
    assert not missing, f"no docstring summary: {missing}"


#: the entry points a user calls first: each documents every parameter by name in its docstring
ENTRY_POINTS = [
    "guardfl:wrap", "guardfl:protect", "guardfl:inspect_model", "guardfl:calibrate", "guardfl.defenses:from_config",
    "guardfl.bounds:defense_bound", "guardfl.integrations.torch:local_update", "guardfl.integrations.flower:train",
    "guardfl.integrations.flower:GuardUpdateMod", "guardfl.integrations.flower:InspectModelMod",
    "guardfl.integrations.flower:RoundBudgetMod", "guardfl.integrations.nvflare:GuardUpdateFilter",
    "guardfl.integrations.nvflare:GuardedTrainer", "guardfl.integrations.nvflare:InspectModelFilter",
    "guardfl.integrations.nvflare:add_update_filter", "guardfl.redteam:certify", "guardfl.redteam:simulate_client",
    "guardfl.redteam:RayJobs", "guardfl:load_plain_state_dict", "guardfl.cli:main",
    "guardfl.integrations.nvflare:add_inspect_filter", "guardfl.integrations.nvflare:train",
    "guardfl.integrations.flower:train_message", "guardfl.integrations.flower:client_state",
    "guardfl.integrations.flower:received_arrays",
    # every defense's constructor (a config's keys are these parameters; its table on Defense configs reads them)
    *sorted(f"guardfl.defenses:{cls.__name__}" for cls in importlib.import_module("guardfl.defenses").REGISTRY.values()),
]


@pytest.mark.parametrize("ref", ENTRY_POINTS)
def test_the_entry_points_document_every_parameter(ref):
    module, name = ref.split(":")
    if "flower" in module:
        pytest.importorskip("flwr")
    if "nvflare" in module:
        pytest.importorskip("nvflare")
    obj = getattr(importlib.import_module(module), name)
    fn = obj.__init__ if inspect.isclass(obj) else obj
    doc = (obj.__doc__ or "") + ((fn.__doc__ or "") if inspect.isclass(obj) else "")
    params = [p for p in inspect.signature(fn).parameters if p not in ("self", "args", "kwargs")]
    missing = [p for p in params if not re.search(rf"\b{p}\b", doc)]
    assert not missing, f"{ref}: parameters not in its docstring: {missing}"


def test_every_defense_config_key_is_described(monkeypatch):
    """The Defense configs page's description column: a Config field's ``#:`` comment, else the defense's
    ``Args:`` entry (docs/gen/fields.py); a new parameter without either fails here, not on the page."""
    monkeypatch.syspath_prepend(str(ROOT / "docs" / "gen"))
    import fields

    from guardfl.defenses import REGISTRY

    empty = [f"{kind}.{row['name']}" for kind, cls in sorted(REGISTRY.items())
             for row in fields.field_rows(cls.Config, owner=cls) if not row["description"].strip()]
    assert not empty, f"defense config keys with no description: {empty}"


# -- the site ---------------------------------------------------------------------------------------------

def _mkdocs() -> list[str]:
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    pytest.importorskip("mkdocstrings")
    pytest.importorskip("mkdocs_gen_files")
    return [sys.executable, "-m", "mkdocs"]


def build(root: Path, site: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "DISABLE_MKDOCS_2_WARNING": "true", "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run([*_mkdocs(), "build", "--strict", "--site-dir", str(site)], cwd=root, env=env,
                          capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    prebuilt = os.environ.get("GUARDFL_DOCS_SITE")  # .ci/run builds the site (strict) once, before the tests
    if prebuilt and (Path(prebuilt) / "index.html").is_file():
        return Path(prebuilt)
    out = tmp_path_factory.mktemp("site")
    done = build(ROOT, out)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return out


def test_the_site_builds_with_every_reference_page(site):
    for page in ("index.html", "reference/config/index.html", "reference/cli/index.html",
                 "reference/attacks/index.html", "reference/defenses/index.html", "reference/api/guardfl/index.html",
                 "reference/api/integrations/index.html", "how-to/choose-a-defense/index.html",
                 "research/malicious-server/index.html"):
        assert (site / page).is_file(), page
    config = (site / "reference/config/index.html").read_text()
    from guardfl.redteam.config_sections import CertifySection, ClientSection

    for key in [f"client.{k}" for k in ClientSection.model_fields] + [f"certify.{k}" for k in CertifySection.model_fields]:
        assert key in config, f"{key} is missing from the generated config reference"
    api = (site / "reference/api/integrations/index.html").read_text()
    assert "local_update" in api and "GuardUpdateFilter" in api and "GuardUpdateMod" in api
    for page in sorted(site.glob("reference/**/index.html")) + sorted(site.glob("how-to/**/index.html")):
        shown = re.findall(r"<code>[^<]*\\\|[^<]*</code>", page.read_text())
        assert not shown, f"{page.relative_to(site)}: an escaped pipe shown in a code span: {shown[:3]}"
    table = (site / "how-to/choose-a-defense/index.html").read_text()
    assert "decision-table" not in table and "configs/research/malicious-adaptive.yaml" in table


def test_a_broken_link_or_reference_fails_the_build_naming_the_page_and_the_link(tmp_path):
    _mkdocs()
    root = tmp_path / "repo"
    shutil.copytree(ROOT, root, ignore=shutil.ignore_patterns(".git", ".venv", "site", "build", "__pycache__",
                                                                 "*.egg-info", ".pytest_cache", ".hypothesis", "bench",
                                                                 "tests", "examples", "redteam-out"))
    page = root / "docs" / "tutorials" / "first-certificate.md"
    page.write_text(page.read_text() + "\n[gone](../no-such-page.md), [gone too][guardfl.no_such_function] and "
                    "[no row](../reference/configs.md#no-such-config)\n")
    done = build(root, tmp_path / "site")
    log = done.stdout + done.stderr
    assert done.returncode != 0
    assert "tutorials/first-certificate.md" in log and "no-such-page.md" in log
    assert "guardfl.no_such_function" in log
    assert "no-such-config" in log  # an anchor the generated configs page does not have


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@contextlib.contextmanager
def serve(directory: Path):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(directory)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.browser
def test_the_index_the_config_reference_and_a_tutorial_open_without_console_errors(site):
    from tests.browser import Browser, browser_path

    if browser_path() is None:
        pytest.skip("no Chromium (chromium, chromium-browser, google-chrome or /usr/bin/chromium)")
    with serve(site) as base, Browser(timeout=60) as browser:
        for page, words in (("", "gradient inversion"), ("reference/config/", "certify.max_leak_rate"),
                            ("tutorials/first-certificate/", "NOT CERTIFIED")):
            report = browser.inspect(f"{base}/{page}", banner_selector="h1")
            assert report.errors == [], (page, report.errors)
            assert words in report.text, page
            assert report.banner_visible, page  # the page's title is on the first screen
            assert not report.broken_anchors, (page, report.broken_anchors)
