"""The wheel as a user gets it, not the editable install the README (and this suite)
uses: every module of the package is in it, and, installed in a virtual environment of
its own, it lets Lightning make a ``Trainer`` outside any nbddp run, from either of
its packages, ``lightning`` or the older ``pytorch_lightning``, the other not installed.

The second matters beyond nbddp: the wheel declares each package's
``callbacks_factory`` entry point, which its Trainer loads whenever it is made, so a
wheel without ``nbddp.integrations``, or an entry point that imports the other package,
breaks every Trainer on the machine. The wheel is built from a copy of the tracked
files (as a fresh clone has them, with nothing left in ``build/`` by an earlier build).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import site
import subprocess
import sys
import textwrap
import venv
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
TIMEOUT = 300


def _tracked_files() -> list[str]:
    """The repository's files as a clone has them (relative paths); outside a git
    checkout, every file but caches."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True,
                                check=True, timeout=60).stdout.decode()
        return [path for path in listed.split("\0") if path and (REPO / path).is_file()]
    except (OSError, subprocess.CalledProcessError):
        return [str(path.relative_to(REPO)) for path in REPO.rglob("*")
                if path.is_file() and "__pycache__" not in path.parts and ".git" not in path.parts]


def _run(command: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``command`` without this suite's PYTHONPATH (the worktree's nbddp), which pip
    would take for an installed nbddp and the virtual environment would import."""
    env = {name: value for name, value in os.environ.items()
           if name not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
    done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT,
                          cwd=cwd, env=env)
    assert done.returncode == 0, (f"{' '.join(command)} failed ({done.returncode}):\n"
                                  f"{done.stdout}\n{done.stderr}")
    return done


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """``pip wheel --no-deps`` of a copy of the tracked files (pip's isolated build)."""
    source = tmp_path_factory.mktemp("clone")
    for path in _tracked_files():
        (source / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / path, source / path)
    out = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(out),
          str(source)])
    built = sorted(out.glob("nbddp-*.whl"))
    assert len(built) == 1, f"expected one nbddp wheel, found {built}"
    return built[0]


def test_wheel_holds_every_module_of_the_package(wheel):
    tracked = {path for path in _tracked_files()
               if path.startswith("nbddp/") and path.endswith(".py")}
    with zipfile.ZipFile(wheel) as archive:
        missing = sorted(tracked - set(archive.namelist()))
    assert tracked and not missing, (
        f"{wheel.name} leaves out {missing}: is each folder a package (__init__.py), "
        "and does pyproject.toml's package discovery find it?")


def _venv_with(wheel: Path, root: Path) -> Path:
    """A virtual environment holding the wheel alone (no editable nbddp), which then
    sees this interpreter's installed packages (torch, Lightning) behind its own."""
    venv.EnvBuilder(with_pip=False).create(root)
    python = root / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
          "--no-index", "--quiet", str(wheel)])
    own = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]
                    ).stdout.strip())
    # Listed, not added as site dirs: their .pth files (the editable nbddp) stay unread.
    theirs = [*site.getsitepackages(), *([site.getusersitepackages()]
                                         if site.ENABLE_USER_SITE else [])]
    (own / "outside-packages.pth").write_text("\n".join(theirs) + "\n")
    return python


GROUPS = {"lightning": "lightning.pytorch.callbacks_factory",
          "pytorch_lightning": "pytorch_lightning.callbacks_factory"}
"""Each Lightning package's own entry point group, which its Trainer loads."""
HIDDEN = {"lightning": ["pytorch_lightning", "lightning_fabric"],
          "pytorch_lightning": ["lightning"]}
"""What is made unimportable beside each: nbddp's entry point for one package must load
where the other is not installed."""


def trainer_script(package: str) -> str:
    """Make ``package``'s Trainer outside any run, the other package unimportable, and
    say what nbddp declared and what the Trainer got."""
    return textwrap.dedent(f"""
        import builtins, importlib.metadata, json, sys
        hidden, tried = {HIDDEN[package]!r}, []
        for name in hidden:
            sys.modules[name] = None  # as if not installed: importing it fails
        real_import = builtins.__import__

        def noting(name, globals=None, *args, **kwargs):
            importer = (globals or {{}}).get("__name__", "")
            if name.split(".")[0] in hidden and importer.startswith("nbddp"):
                tried.append(f"{{importer}}: {{name}}")
            return real_import(name, globals, *args, **kwargs)

        builtins.__import__ = noting
        import {package}
        import nbddp

        ours = importlib.metadata.distribution("nbddp")
        declared = [(ep.name, ep.value) for ep in ours.entry_points
                    if ep.group == "{GROUPS[package]}"]
        # The Trainer loads every entry point of its group here, nbddp's too.
        trainer = {package}.Trainer(accelerator="cpu", devices=1, logger=False,
                                    enable_checkpointing=False, enable_progress_bar=False,
                                    enable_model_summary=False)
        import nbddp.integrations.{package}
        print(json.dumps({{
            "module": nbddp.__file__,
            "metadata": str(ours.locate_file("")),
            "declared": declared,
            "nbddp_callbacks": [type(cb).__name__ for cb in trainer.callbacks
                                if type(cb).__module__.startswith("nbddp")],
            "other_tried": tried,
        }}))
    """)


@pytest.mark.parametrize("package", ["lightning", "pytorch_lightning"])
def test_installed_wheel_lets_lightning_make_a_trainer_outside_a_run(wheel, tmp_path, package):
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed (the frameworks extra): "
                    "the wheel's entry point for it has nothing to load it")
    root = (tmp_path / "venv").resolve()
    python = _venv_with(wheel, root)
    workdir = tmp_path / "elsewhere"
    workdir.mkdir()
    script = workdir / "trainer_outside_a_run.py"
    script.write_text(trainer_script(package))
    done = _run([str(python), str(script)], cwd=workdir)
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert Path(seen["module"]).resolve().is_relative_to(root), seen  # not the editable one
    assert Path(seen["metadata"]).resolve().is_relative_to(root), seen
    assert seen["declared"] == [
        ["nbddp", f"nbddp.integrations.{package}:callbacks_in_a_run"]], seen
    assert seen["nbddp_callbacks"] == [], seen  # outside a run, the entry point adds none
    assert seen["other_tried"] == [], seen  # nothing of the other package, not even tried
