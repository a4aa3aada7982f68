"""What the magics ask of the IPython shell that runs the cell: its number, whether a
trailing ``;`` hides its value, and IPython's own post-mortem, put aside for a cell whose
ranks open their own.

Imports nothing of nbddp's.
"""

from __future__ import annotations

from typing import Any

from IPython.core.displayhook import DisplayHook


def unless_hidden(value: Any, cell: str) -> Any:
    """The cell's value, or None if the cell ends in ';' (a comment after it aside): a
    trailing ';' hides the value, as in any cell. IPython's own check for magics
    (``output_can_be_silenced``) tokenises the whole cell at every run; a cell with no
    ';' in it cannot end in one."""
    if ";" in cell and DisplayHook.semicolon_at_end_of_expression(cell):
        return None
    return value


def without_ipythons_own_post_mortem(shell: Any) -> None:
    """``%pdb on`` makes IPython open its debugger on whatever a cell raises: for a
    ``%%ddp`` cell, that would be nbddp's frame in the kernel, right after the rank's
    own post-mortem. Off for this cell; back on once it has run."""
    shell.call_pdb = False

    def back_on(_: Any = None) -> None:
        shell.call_pdb = True
        shell.events.unregister("post_run_cell", back_on)

    shell.events.register("post_run_cell", back_on)


def running_cell_number(shell: Any) -> int:
    """The number of the cell being run (its ``In[N]``), which its traceback lines show.

    ``shell.execution_count`` is the next cell's number on IPython 9 (which counts a cell
    before running it) and this cell's on IPython 8 (after), so it is not asked directly:
    the running cell's own ``ExecutionResult`` (set while its code runs) has the number
    IPython compiled it under; outside ``run_cell`` the display hook's prompt number."""
    running = getattr(shell.displayhook, "exec_result", None)
    number = getattr(running, "execution_count", None)
    if number is not None:
        return int(number)
    return int(getattr(shell.displayhook, "prompt_count", shell.execution_count))
