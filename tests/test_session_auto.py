"""``%ddp_session auto on|off`` through a real kernel: every cell runs on the session's
ranks as if it began with ``%%ddp``; magics and shell lines stay in the notebook; off,
or the session's end, brings the notebook back."""

from __future__ import annotations

import os
import re

import pytest

from .kernel_driver import Kernel
from .test_session import kernel_with_session

pytestmark = pytest.mark.slow


@pytest.fixture
def akernel(tmp_path):
    with kernel_with_session(tmp_path) as kernel:
        yield kernel


def notebook_names(kernel: Kernel) -> list[str]:
    return eval(kernel.run("%who_ls").assert_ok().result())  # noqa: S307 - a list's repr


def test_auto_mode_runs_cells_on_the_ranks_and_leaves_magics_and_shell_lines_here(akernel):
    said = akernel.run("%ddp_session auto on").assert_ok().stream_text()
    assert "auto mode on: every cell runs on the session's ranks" in said
    run = akernel.run("import torch.distributed as dist\nz = dist.get_rank() + 5\nz")
    assert run.assert_ok().result() == "5"  # rank 0's value
    assert re.search(r"on 2 ranks \(session · run \d+, auto mode\)", run.stream_text()), \
        run.describe()
    assert "z" not in notebook_names(akernel)  # it lives on the ranks
    assert "from the shell" in akernel.run("!echo from the shell").assert_ok().stream_text()
    assert akernel.run("z + 1").assert_ok().result() == "6"  # the ranks' z
    failed = akernel.run("y = 1\nraise ValueError('boom')")
    error = failed.error()
    assert error is not None and error["ename"] == "WorkerError", failed.describe()
    assert "line 2" in "\n".join(error["traceback"])  # the cell's own lines, no %%ddp line
    akernel.run("%ddp_session auto off").assert_ok()
    assert akernel.run("q = 3\nq").assert_ok().result() == "3"
    assert "q" in notebook_names(akernel)


def test_stopping_the_session_ends_auto_mode(akernel):
    akernel.run("%ddp_session auto on").assert_ok()
    said = akernel.run("%ddp_session stop").assert_ok().stream_text()
    assert "auto mode is off: cells run in the notebook" in said
    assert akernel.run("w = 7\nw").assert_ok().result() == "7"
    assert "w" in notebook_names(akernel)


def test_auto_mode_needs_a_session_and_on_or_off(akernel):
    err = akernel.run("%ddp_session auto maybe").assert_ok().stream_text("stderr")
    assert "UsageError: %ddp_session auto takes on or off" in err
    akernel.run("%ddp_session stop").assert_ok()
    err = akernel.run("%ddp_session auto on").assert_ok().stream_text("stderr")
    assert "UsageError: auto mode runs every cell on a session's ranks" in err


# --- autoreload -----------------------------------------------------------------------

OLD = '''
class Model:
    def __init__(self):
        self.weight = 1.0

    def describe(self):
        return f"old {self.weight}"
'''


def write(path, text: str, bump: float) -> None:
    """Write a module file and move its time on (an edit within the same second must
    still look newer)."""
    import os
    import time

    path.write_text(text)
    later = time.time() + bump
    os.utime(path, (later, later))


def test_an_edited_module_takes_effect_on_the_ranks_with_their_state_kept(akernel, tmp_path):
    module = tmp_path / "shapes.py"
    write(module, OLD, 0)
    said = akernel.run("%ddp_session autoreload on").assert_ok().stream_text()
    assert "autoreload on: before each cell, the ranks reload the modules you edited" in said
    first = akernel.run("%%ddp\nimport shapes\nmodel = shapes.Model()\nmodel.weight = 42.0\n"
                        "model.describe()").assert_ok()
    assert first.result() == "'old 42.0'"
    write(module, OLD.replace("old", "new"), 2)
    assert akernel.run("%%ddp\nmodel.describe()").assert_ok().result() == "'new 42.0'"
    write(module, OLD.replace("def describe(self):", "def describe(self:"), 4)
    broken = akernel.run("%%ddp\nmodel.weight = 0.0")
    error = broken.error()
    assert error is not None and error["ename"] == "WorkerError", broken.describe()
    text = "\n".join(error["traceback"])
    assert f"autoreload: module 'shapes' ({module}) could not be reloaded, so the ranks " \
           "keep its old code: SyntaxError" in text, text
    # The cell did not run, and the ranks kept their state and the old code:
    assert akernel.run("%%ddp\nmodel.describe()").assert_ok().result() == "'new 42.0'"
    write(module, OLD.replace("old", "fixed"), 6)
    assert akernel.run("%%ddp\nmodel.describe()").assert_ok().result() == "'fixed 42.0'"


def test_autoreload_follows_the_notebooks_own_until_set(akernel):
    assert "autoreload off" in akernel.run("%ddp_session").assert_ok().result()
    akernel.run("%load_ext autoreload\n%autoreload 2").assert_ok()
    assert "autoreload on" in akernel.run("%ddp_session").assert_ok().result()
    akernel.run("%ddp_session autoreload off").assert_ok()
    assert "autoreload off" in akernel.run("%ddp_session").assert_ok().result()


def test_a_module_written_between_cells_imports_on_the_ranks(akernel, tmp_path):
    """The ranks listed this folder when the first cell imported from it; a module
    written after (by an editor, or a cell's ``%%writefile``) imports in the next cell.
    The folder's time is set back, as a coarse clock or a network disk leaves it: the
    import system would otherwise notice the change by itself."""
    write(tmp_path / "first_module.py", "VALUE = 1\n", 0)
    assert akernel.run("%%ddp\nimport first_module\nfirst_module.VALUE"
                       ).assert_ok().result() == "1"
    listed = os.stat(tmp_path).st_mtime_ns
    (tmp_path / "second_module.py").write_text("VALUE = 2\n")
    os.utime(tmp_path, ns=(listed, listed))
    assert akernel.run("%%ddp\nimport second_module\nsecond_module.VALUE"
                       ).assert_ok().result() == "2"
