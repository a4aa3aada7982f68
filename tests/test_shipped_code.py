"""The notebook's own modules as files for the ranks: which ship, once, and how a node
installs them (``_wire.users_code``, ``_wire.shipped_code``). The real thing, a Ray node
that cannot see the notebook's folder, is ``test_ray_code``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from nbddp._wire.dataplane import Packed
from nbddp._wire.payload import Payload
from nbddp._wire.shipped_code import RanksCode, install
from nbddp._wire.users_code import imported_names

pytestmark = pytest.mark.fast


@pytest.fixture
def notebook(tmp_path, monkeypatch):
    """A notebook's folder on the import path: a module importing another, a package
    with a data file and a stale cache, and a module the kernel imported."""
    folder = tmp_path / "notebook"
    (folder / "mypkg" / "data").mkdir(parents=True)
    (folder / "mypkg" / "__pycache__").mkdir()
    (folder / "helpers.py").write_text("import utils\nVALUE = utils.BASE + 1\n")
    (folder / "utils.py").write_text("BASE = 41\n")
    (folder / "unused.py").write_text("NOBODY = 'imports me'\n")
    (folder / "mypkg" / "__init__.py").write_text("from . import model\n")
    (folder / "mypkg" / "model.py").write_text("class Net:\n    layers = 3\n")
    (folder / "mypkg" / "data" / "config.json").write_text(json.dumps({"width": 64}))
    (folder / "mypkg" / "__pycache__" / "model.cpython-311.pyc").write_bytes(b"stale")
    monkeypatch.syspath_prepend(str(folder))
    return folder


def shipped(code) -> dict[str, bytes]:
    """The files ``code`` carries from a notebook's folder (this test process's own
    modules, the suite's among them, ship from theirs too)."""
    return {} if code is None else {relative: data for root, relative, _, data in code.files
                                    if root.endswith("notebook")}


def test_import_lines_name_their_top_level_modules():
    source = textwrap.dedent("""\
        import os, helpers as h
        from mypkg.model import Net
            import torch.nn.functional as F
        from . import relative
        x = 'import nothing'
        """)
    assert imported_names(source) == {"os", "helpers", "mypkg", "torch"}


def test_named_modules_ship_with_what_they_import_and_packages_whole(notebook):
    code = RanksCode().changes({"helpers", "mypkg", "os", "json", "torch", "nbddp"}, False)
    assert code is not None
    assert set(shipped(code)) == {"helpers.py", "utils.py", "mypkg/__init__.py",
                                  "mypkg/model.py", "mypkg/data/config.json"}
    assert code.roots[0] == str(notebook)  # (first on the import path)
    assert shipped(code)["utils.py"] == b"BASE = 41\n"


def test_nothing_ships_twice_and_an_edit_ships_alone(notebook):
    ranks = RanksCode()
    first = ranks.changes({"helpers"}, look_at_files=False)
    assert first is not None
    ranks.taught(first)
    assert ranks.changes({"helpers"}, look_at_files=True) is None
    assert ranks.changes({"helpers"}, look_at_files=False) is None
    (notebook / "utils.py").write_text("BASE = 99\n")
    assert ranks.changes({"helpers"}, look_at_files=False) is None  # (autoreload off)
    edit = ranks.changes({"helpers"}, look_at_files=True)
    assert edit is not None and shipped(edit) == {"utils.py": b"BASE = 99\n"}


def test_files_not_known_held_ship_again_until_a_run_confirms_them(notebook):
    ranks = RanksCode()
    first = ranks.changes({"helpers"}, False)
    assert set(shipped(first)) >= {"helpers.py", "utils.py"}
    again = ranks.changes(set(), False)  # (the run that carried them failed: not taught)
    assert shipped(again) == shipped(first)
    ranks.taught(again)
    assert ranks.changes(set(), False) is None


def test_a_module_written_after_a_miss_is_found(notebook):
    ranks = RanksCode()
    assert "later.py" not in shipped(ranks.changes({"later"}, False))
    time.sleep(0.01)
    (notebook / "later.py").write_text("ANSWER = 1\n")
    os.utime(notebook, None)
    assert "later.py" in shipped(ranks.changes({"later"}, False))


def test_modules_the_kernel_imported_ship_unasked(notebook):
    import utils  # noqa: F401 - imported here, as a notebook's cell would

    try:
        assert "utils.py" in shipped(RanksCode().changes(set(), False))
    finally:
        sys.modules.pop("utils", None)


def test_a_node_installs_before_the_kernels_folder_and_rewrites_only_changes(
        notebook, tmp_path):
    node = tmp_path / "node"
    node.mkdir(mode=0o700)
    code = RanksCode().changes({"helpers"}, False)
    install(code, node)
    mirror = node / "code" / str(notebook).lstrip("/")
    assert (mirror / "helpers.py").read_bytes() == (notebook / "helpers.py").read_bytes()
    assert sys.path[0] == str(mirror)  # (before an installed module of the same name too)
    before = (mirror / "utils.py").stat().st_mtime_ns
    install(code, node)
    assert (mirror / "utils.py").stat().st_mtime_ns == before


def test_a_payload_brings_the_users_modules_to_a_rank_that_cannot_see_them(
        notebook, tmp_path):
    """The payload of a function using ``helpers`` (imported in the kernel) and
    ``mypkg`` (only named in its code) is unpacked by a fresh Python whose working
    directory and import path do not hold the notebook's folder, which is then gone."""
    import helpers

    def uses_them():
        from mypkg.model import Net
        return helpers.VALUE, Net.layers

    try:
        packed = Payload.capture(uses_them, (), {}).dumps(code=RanksCode())
    finally:
        sys.modules.pop("helpers", None)
        sys.modules.pop("utils", None)
    assert packed.code is not None and packed.code.code is not None
    payload_file = tmp_path / "payload.pickle"
    payload_file.write_bytes(packed.data)
    hidden = notebook.rename(tmp_path / "elsewhere")
    node = tmp_path / "node"
    node.mkdir(mode=0o700)
    script = textwrap.dedent(f"""\
        import pathlib
        from nbddp._wire.dataplane import Packed
        from nbddp._wire.payload import Payload
        payload = Payload.unpack(Packed(pathlib.Path({str(payload_file)!r}).read_bytes()),
                                 pathlib.Path({str(node)!r}))
        print(payload.fn())
        """)
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, text=True,
                          capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "(42, 3)"
    assert not (hidden / "helpers.py").samefile(
        node / "code" / str(notebook).lstrip("/") / "helpers.py")


def test_an_edit_within_the_same_second_and_size_is_not_hidden_by_bytecode(
        notebook, tmp_path):
    """Python's bytecode cache keeps the source's time in whole seconds and its size: a
    file rewritten in place must drop it, or the old code would be imported again."""
    node = tmp_path / "node"
    node.mkdir(mode=0o700)
    ranks = RanksCode()
    first = ranks.changes({"utils"}, False)
    ranks.taught(first)
    (notebook / "utils.py").write_text("BASE = 42\n")  # (same size, same second)
    edit = ranks.changes({"utils"}, True)
    script = textwrap.dedent("""\
        import importlib, pathlib, pickle, sys
        from nbddp._wire.shipped_code import install
        first, edit, node = pickle.loads(sys.stdin.buffer.read())
        install(first, node)
        import utils
        assert utils.BASE == 41, utils.BASE
        install(edit, node)
        print(importlib.reload(utils).BASE)
        """)
    import pickle

    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path,
                          input=pickle.dumps((first, edit, node)), capture_output=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout.decode().strip() == "42"


def test_a_new_submodule_and_data_file_ship_once_autoreload_looks(notebook):
    ranks = RanksCode()
    ranks.taught(ranks.changes({"mypkg"}, False))
    time.sleep(0.01)
    (notebook / "mypkg" / "layers.py").write_text("DEPTH = 4\n")
    (notebook / "mypkg" / "data" / "vocab.txt").write_text("a b c\n")
    assert "mypkg/layers.py" not in shipped(ranks.changes(set(), False))
    assert set(shipped(ranks.changes(set(), True))) == {"mypkg/layers.py",
                                                       "mypkg/data/vocab.txt"}


def test_a_module_an_edit_newly_imports_ships_with_the_edit(notebook):
    ranks = RanksCode()
    ranks.taught(ranks.changes({"helpers"}, False))
    (notebook / "helpers.py").write_text("import utils, unused\nVALUE = utils.BASE + 2\n")
    assert set(shipped(ranks.changes(set(), True))) == {"helpers.py", "unused.py"}


def test_a_first_import_after_an_edit_gets_the_edit_without_autoreload(notebook):
    """A cell that names the module (its import line) looks at its files again, as a
    first import on a rank that can see the folder would read the edited file."""
    ranks = RanksCode()
    ranks.taught(ranks.changes({"helpers"}, False))
    (notebook / "helpers.py").write_text("import utils\nVALUE = -1\n")
    assert ranks.changes({"os"}, False) is None  # (a cell that does not name it)
    assert shipped(ranks.changes({"helpers"}, False)) == {
        "helpers.py": b"import utils\nVALUE = -1\n"}


def test_a_shipped_path_that_would_leave_the_code_folder_is_refused(tmp_path):
    from nbddp._wire.shipped_code import ShippedCode

    escape = ShippedCode((("/nb", "../../../outside.py", "0" * 64, b"x = 1\n"),), ("/nb",))
    with pytest.raises(ValueError, match="leaves the code folder"):
        install(escape, tmp_path)
    assert not (tmp_path / "outside.py").exists()


def test_payload_without_code_carries_none():
    packed = Payload.capture(len, ([1],), {}).dumps()
    assert packed.code is None
    assert Payload.unpack(Packed(packed.data)).fn is len


def test_nbddp_ship_code_0_keeps_the_modules_home(monkeypatch):
    from nbddp._wire.shipped_code import wanted

    assert wanted()
    monkeypatch.setenv("NBDDP_SHIP_CODE", "0")
    assert not wanted()
