"""The house's rules, read from the imports of every module (also those inside functions).

Packages sit in floors; a package imports only the ones its rule names, so a change that
would make a rank load the kernel's machinery, or the neutral core depend on a backend,
fails here rather than in a review. See docs/architecture.md.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast  # the fast lane: bash scripts/test.sh --fast

PACKAGE = Path(__file__).resolve().parents[1] / "nbddp"
FLOOR = {"_errors", "_version"}
"""Leaf modules every package may use: the exceptions a user catches, and the version."""
FRONT_DOOR = {"__init__", "_launch", "_session", "_magic", "_session_switches", "_cluster_flags",
              "_backends", "_worker", "_torchrun"}
BACKENDS = {"_local", "_slurm", "_ray"}
"""The backends: packages that place and start rank groups (see ``_run.backend``)."""
CHOOSER = "_backends"
"""The one front-door module that names the backends."""
ALLOWED = {
    "_wire": set(),
    "_rank": {"_wire"},
    "_panel": {"_wire", "_notebook"},
    "_run": {"_panel", "_wire"},
    "_local": {"_run", "_panel", "_wire"},
    "_slurm": {"_run", "_panel", "_wire"},
    "_ray": {"_run", "_wire"},
    "_export": {"_slurm", "_rank", "_run", "_wire"},
    "integrations": {"_rank", "_wire"},
    "_notebook": set(),
}
"""What each package may import besides itself and the floor. The front door (the
public API and the two entry modules) may import anything."""
ENTRY_MODULES = {"_worker": {"_rank"}, "_torchrun": {"_rank"}}
"""``python -m nbddp._worker`` and ``-m nbddp._torchrun`` run on a rank's machine: thin
modules that hand over to ``_rank``."""


def _room(module: str) -> str:
    """The package (or front-door module) a dotted name under nbddp belongs to."""
    return module.split(".")[0]


def _imports(path: Path, package_root: Path) -> set[str]:
    """Every nbddp module ``path`` imports, as a dotted name under nbddp."""
    package = list(path.relative_to(package_root).parts[:-1])
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)]
            elif (node.module or "").split(".")[0] == "nbddp":
                base = []
                node = ast.ImportFrom(node.module.removeprefix("nbddp").lstrip("."),
                                      node.names, 1)
            else:
                continue
            if node.module:
                found.add(".".join([*base, node.module]))
            else:  # from . import x: each name is a module (or a package's attribute)
                found.update(".".join([*base, alias.name]) for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name.removeprefix("nbddp.") for alias in node.names
                         if alias.name.startswith("nbddp."))
    return {name for name in found if name}


def _violations(package_root: Path = PACKAGE) -> list[str]:
    problems = []
    for path in sorted(package_root.rglob("*.py")):
        module = ".".join(path.relative_to(package_root).with_suffix("").parts)
        imported = _imports(path, package_root)
        room = _room(module)
        if room in FRONT_DOOR - set(ENTRY_MODULES) or room in FLOOR:
            if room in FLOOR and imported:
                problems.append(f"{module} is on the floor but imports {sorted(imported)}")
            continue
        allowed = ENTRY_MODULES.get(room, ALLOWED.get(room))
        if allowed is None:
            problems.append(f"{module} is in no room of the house (add it to a package)")
            continue
        for target in sorted(imported):
            target_room = _room(target)
            if target_room not in {room, *allowed, *FLOOR}:
                problems.append(f"{module} imports {target}")
    return problems


def test_every_module_keeps_to_the_rules_of_its_package():
    assert _violations() == []


def test_the_rules_see_imports_inside_functions_and_relative_ones(tmp_path):
    """The reader is what the rules stand on: it must see every way of importing."""
    fake = tmp_path / "nbddp"
    (fake / "_rank").mkdir(parents=True)
    (fake / "_rank" / "bad.py").write_text(
        "from .._run.job import Job\n"
        "def later():\n"
        "    from .. import _session\n"
        "    import nbddp._panel.chart\n"
        "    from nbddp._local import standby\n")
    (fake / "_wire").mkdir()
    (fake / "_wire" / "fine.py").write_text("from . import messages\nfrom .._errors import X\n")
    (fake / "stray.py").write_text("")
    assert _violations(fake) == [
        "_rank.bad imports _local",
        "_rank.bad imports _panel.chart",
        "_rank.bad imports _run.job",
        "_rank.bad imports _session",
        "stray is in no room of the house (add it to a package)",
    ]


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_each_package_says_what_it_owns(package):
    init = PACKAGE / package / "__init__.py"
    assert init.exists() and ast.get_docstring(ast.parse(init.read_text()))


def test_no_module_is_left_in_the_flat_folder_but_the_front_door():
    flat = {path.stem for path in PACKAGE.glob("*.py")}
    assert flat == FRONT_DOOR | FLOOR


def test_the_architecture_page_states_these_rules():
    """docs/architecture.md's table of packages says what this test enforces."""
    page = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    stated = {}
    for row in re.findall(r"^\| `(\w+)` \|[^|]*\| ([^|]*) \|$", page, re.M):
        package, may = row
        stated[package] = set() if may.strip() == "nothing" else set(re.findall(r"`(\w+)`", may))
    assert stated == ALLOWED


def test_the_marks_notebooks_ask_for_are_the_suites_own():
    """A notebook says its marks in its metadata (the lanes, and the clusters a run may
    not skip, are chosen by them, see conftest): a misspelt one would silently leave it
    in the wrong lane, or let it skip."""
    import json

    known = set(re.findall(r'^    "(\w+): ', (PACKAGE.parent / "pyproject.toml").read_text(),
                           re.M))
    asked = {mark for notebook in (PACKAGE.parent / "notebooks").glob("*.ipynb")
             for mark in json.loads(notebook.read_text())["metadata"]
             .get("nbddp_test", {}).get("marks", [])}
    assert asked and asked <= known, asked - known


def test_the_front_door_names_the_backends_in_one_module_only():
    """``launch``, ``Session``, attach and the magics drive every backend through
    ``_run.backend.Backend``: a new backend touches the front door where it is chosen."""
    naming = {}
    for module in FRONT_DOOR - set(ENTRY_MODULES):
        path = PACKAGE / f"{module}.py"
        rooms = {_room(target) for target in _imports(path, PACKAGE)}
        naming[module] = rooms & BACKENDS
    assert {module for module, named in naming.items() if named} == {CHOOSER}
    assert naming[CHOOSER] == BACKENDS


@pytest.mark.parametrize("package", sorted(BACKENDS))
def test_each_backend_offers_runs_sessions_and_attach_through_the_neutral_interface(package):
    """Each backend has a ``backend`` module with a subclass of ``Backend`` (its runs,
    sessions, placement), which the front door's chooser imports."""
    path = PACKAGE / package / "backend.py"
    tree = ast.parse(path.read_text())
    subclasses = [node.name for node in ast.walk(tree) if isinstance(node, ast.ClassDef)
                  and any(getattr(base, "id", None) == "Backend" for base in node.bases)]
    assert subclasses, f"{package}/backend.py defines no Backend"
    assert f"{package}.backend" in _imports(PACKAGE / f"{CHOOSER}.py", PACKAGE)
    assert ALLOWED[package] & BACKENDS == set()  # no backend leans on another's insides
