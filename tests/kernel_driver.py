"""A real Jupyter kernel driven like a notebook front end, for the tests.

Each cell's messages are collected by the cell they belong to (its ``msg_id``), with
the time each arrived, so tests can check what a user would see under each cell.
"""

from __future__ import annotations

import os
import re
import signal
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from queue import Empty

from jupyter_client.manager import start_new_kernel

CELL_TIMEOUT = 180.0  # no cell here should come near this; it only stops a hang
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


# --- driving a kernel -----------------------------------------------------------------


@dataclass
class Output:
    msg_type: str  # stream | error | execute_result | display_data | update_display_data
    content: dict
    arrived: float  # time.monotonic() when the message was received


@dataclass
class Execution:
    """One cell run in the kernel, and the output messages it produced so far."""

    kernel: Kernel
    msg_id: str
    outputs: list[Output] = field(default_factory=list)
    idle_at: float | None = None

    def _pump(self, timeout: float) -> bool:
        """Read iopub messages until one more output of this cell or its end; False on time.

        Messages of other cells are recorded on their own ``Execution``, not dropped.
        """
        deadline = time.monotonic() + timeout
        while self.idle_at is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            try:
                msg = self.kernel.kc.get_iopub_msg(timeout=remaining)
            except Empty:
                return False
            owner = self.kernel.executions.get(msg["parent_header"].get("msg_id"))
            if owner is not None and owner._record(msg) and owner is self:
                return True
        return True

    def _record(self, msg: dict) -> bool:
        """Keep an output message of this cell; True if it was an output."""
        kind = msg["msg_type"]
        if kind == "status" and msg["content"]["execution_state"] == "idle":
            self.idle_at = time.monotonic()
        elif kind in ("stream", "error", "execute_result", "display_data",
                      "update_display_data"):
            self.outputs.append(Output(kind, msg["content"], time.monotonic()))
            return True
        return False

    def wait_for_output(self, text: str, timeout: float = CELL_TIMEOUT) -> None:
        """Block until ``text`` shows up in this cell's stream output."""
        deadline = time.monotonic() + timeout
        while text not in self.stream_text():
            if self.idle_at is not None:
                raise AssertionError(f"cell ended without printing {text!r}:\n{self.describe()}")
            if not self._pump(deadline - time.monotonic()):
                raise AssertionError(f"{text!r} not printed within {timeout} s:\n"
                                     f"{self.describe()}")

    def finish(self, timeout: float = CELL_TIMEOUT) -> Execution:
        """Wait until the cell has finished running (the kernel went idle for it)."""
        deadline = time.monotonic() + timeout
        while self.idle_at is None:
            if not self._pump(deadline - time.monotonic()):
                raise AssertionError(f"cell still running after {timeout} s:\n{self.describe()}")
        return self

    # what the user sees

    def stream_text(self, name: str | None = None) -> str:
        return "".join(o.content["text"] for o in self.outputs
                       if o.msg_type == "stream" and name in (None, o.content["name"]))

    def shown_text(self) -> str:
        """The cell's output as it finally stands: its streams, and each display's last
        state (where a rank's last lines may stay, see ``_panel.output.DisplayedLines``)."""
        shown: dict[str, str] = {}
        for n, o in enumerate(self.outputs):
            if o.msg_type == "stream":
                shown[f"stream-{n}"] = o.content["text"]
            elif o.msg_type in ("display_data", "update_display_data"):
                key = o.content.get("transient", {}).get("display_id") or f"display-{n}"
                if o.msg_type == "display_data" or key in shown:
                    shown[key] = o.content.get("data", {}).get("text/plain", "") + "\n"
        return "".join(shown.values())

    def result(self) -> str | None:
        for o in self.outputs:
            if o.msg_type == "execute_result":
                return o.content["data"]["text/plain"]
        return None

    def error(self) -> dict | None:
        for o in self.outputs:
            if o.msg_type == "error":
                return o.content
        return None

    def error_text(self) -> str:
        error = self.error()
        return "" if error is None else _ANSI.sub("", "\n".join(error["traceback"]))

    def describe(self) -> str:
        lines = []
        for o in self.outputs:
            if o.msg_type == "stream":
                lines.append(f"[{o.content['name']}] {o.content['text']}")
            elif o.msg_type == "error":
                lines.append(f"[error {o.content['ename']}] " + self.error_text())
            else:
                lines.append(f"[{o.msg_type}] {o.content.get('data', {}).get('text/plain')}")
        return "".join(line if line.endswith("\n") else line + "\n" for line in lines)

    def assert_ok(self) -> Execution:
        assert self.error() is None, f"cell raised:\n{self.describe()}"
        return self


class Kernel:
    """A python3 ipykernel with a blocking client."""

    def __init__(self, cwd: Path, arguments: list[str] | None = None,
                 env: dict[str, str] | None = None) -> None:
        """Start it in ``cwd``, with ``arguments`` for ipykernel's command line and
        ``env`` for its environment (default: this process's)."""
        options = dict(kernel_name="python3", startup_timeout=180, cwd=str(cwd),
                       extra_arguments=arguments or [],
                       env=env if env is not None else dict(os.environ))
        try:
            self.km, self.kc = start_new_kernel(**options)
        except RuntimeError as exc:
            # jupyter_client picks the kernel's five TCP ports, frees them, and the kernel
            # binds them a second later: another process (the suite's other lane, a
            # rank's gloo connection) can take one between, and the kernel dies at start.
            # start_new_kernel cleaned up; a second start gets other ports.
            if "died before replying" not in str(exc):
                raise
            self.km, self.kc = start_new_kernel(**options)
        self.pid: int = self.km.provisioner.pid
        self.executions: dict[str, Execution] = {}

    def submit(self, code: str) -> Execution:
        execution = Execution(self, self.kc.execute(textwrap.dedent(code), store_history=True))
        self.executions[execution.msg_id] = execution
        return execution

    def run(self, code: str, timeout: float = CELL_TIMEOUT) -> Execution:
        return self.submit(code).finish(timeout)

    def end(self, how: str) -> None:
        """End the kernel as a user's might end: ``"killed"`` (SIGKILL) or ``"shut down"``
        (a shutdown request, as a front end's Shut Down sends)."""
        if how == "killed":
            os.kill(self.pid, signal.SIGKILL)
        else:
            self.kc.stop_channels()
            self.km.shutdown_kernel(now=False)

    def shutdown(self) -> None:
        """Stop the client and the kernel (if it is not gone already)."""
        try:
            self.kc.stop_channels()
        finally:
            if self.km.has_kernel:
                self.km.shutdown_kernel(now=True)
