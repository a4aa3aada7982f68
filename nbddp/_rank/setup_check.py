"""What a rank can tell about its own process-group set-up, for a hang inside it.

A rank stuck in ``init_process_group`` shows only torch's helpers in its stack
(``_new_process_group_helper``), and says nothing of the cause, which the rank itself
can often see:

- the ``rank`` and ``world_size`` the call was given, beside the ones torchrun gave the
  rank (a library whose ``get_rank`` returns 0 everywhere makes every rank rank 0), and
  an ``init_method`` of its own, where every rank is told to use torchrun's agent store
  (no rank then hosts a store at that address);
- a ``MASTER_ADDR`` or ``MASTER_PORT`` changed since the run began (ranks that meet at
  different addresses never meet);
- processes the rank started (a library's workers) that inherited torchrun's
  ``TORCHELASTIC_USE_AGENT_STORE=True``: their ``init_process_group`` waits for
  torchrun's agent store, which none of them hosts.

``remember_launch`` notes torchrun's world as a run begins; ``look`` reads the rest when
the kernel asks where the rank is (from the channel's thread, while the main thread
waits). The kernel lines the ranks' looks up (``_run.diagnosis.setup_report``).
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from types import FrameType
from urllib.parse import urlsplit

from .._wire.hang_messages import AGENT_STORE_ENV, SetupLook
from .._wire.processes import descendants

_WORLD = ("RANK", "WORLD_SIZE")
_ADDRESS = ("MASTER_ADDR", "MASTER_PORT")
_given: dict[str, str | None] = {}
_LOOK_WAIT = 1.0


def remember_launch() -> None:
    """Note the world and the address torchrun gave this rank, before the user's code
    first runs (a session's later cells may change them: still the rank's change)."""
    if not _given:
        _given.update({name: os.environ.get(name) for name in (*_WORLD, *_ADDRESS)})


def look(wait: float = _LOOK_WAIT) -> SetupLook | None:
    """What this rank can say about its process-group set-up, or None if nothing (or
    not within ``wait`` s: reading a stuck child's /proc files may block). Never raises."""
    found: list[SetupLook | None] = []
    looking = threading.Thread(target=lambda: found.append(_look()), daemon=True,
                               name="nbddp-setup-look")
    looking.start()
    looking.join(wait)
    return found[0] if found else None


def _look() -> SetupLook | None:
    """None where the main thread is not in ``init_process_group``, and the rank has
    a process group or changed nothing and started no process set to use the agent
    store: then set-up is not where it waits (a DataLoader's workers inherit the
    variable too, harmlessly)."""
    try:
        call = _init_call(sys._current_frames().get(threading.main_thread().ident or 0))
        if call is None and _has_group():
            return None
        changed = tuple((name, _given.get(name), os.environ.get(name)) for name in _ADDRESS
                        if name in _given and os.environ.get(name) != _given[name])
        children = _agent_store_children()
        if call is None and not changed and not children:
            return None
        rank, world_size, init_method = call if call is not None else (None, None, None)
        return SetupLook(in_init=call is not None, rank=rank, world_size=world_size,
                         init_method=init_method,
                         torchrun_rank=_number(_given.get("RANK")),
                         torchrun_world_size=_number(_given.get("WORLD_SIZE")),
                         changed=changed, agent_store_children=children,
                         agent_store=_on_agent_store())
    except Exception:  # noqa: BLE001 - a look that fails must not stop the rank
        return None


def _has_group() -> bool:
    dist = sys.modules.get("torch.distributed")
    return bool(dist is not None and dist.is_available() and dist.is_initialized())


def _on_agent_store() -> bool:
    return os.environ.get(AGENT_STORE_ENV) == "True"


def _init_call(frame: FrameType | None) -> tuple[int | None, int | None, str | None] | None:
    """The ``rank``, ``world_size`` and ``init_method`` the main thread's
    ``init_process_group`` was given (None where it was left to the environment, and the
    ``init_method`` only beside the agent store), or None if it is not in one."""
    while frame is not None:
        code = frame.f_code
        if code.co_name == "init_process_group" and code.co_filename.endswith(
                "distributed_c10d.py"):
            given = frame.f_locals
            method = given.get("init_method")
            return (_passed(given.get("rank")), _passed(given.get("world_size")),
                    method if _elsewhere(method) else None)
        frame = frame.f_back
    return None


def _elsewhere(method: object) -> bool:
    """A ``tcp://`` address other than torchrun's store's, beside the agent store: no
    rank hosts a store there (``file://`` and ``env://`` are no such case)."""
    if not (isinstance(method, str) and method.startswith("tcp://") and _on_agent_store()):
        return False
    address = urlsplit(method)
    return (address.hostname, str(address.port)) != (_given.get("MASTER_ADDR"),
                                                    _given.get("MASTER_PORT"))


def _passed(value: object) -> int | None:
    """An argument's value, or None for torch's default (-1: read the environment)."""
    return value if isinstance(value, int) and value >= 0 else None


def _number(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def _agent_store_children() -> tuple[tuple[int, str], ...]:
    """The processes this rank started (its descendants that ran a program of their own:
    a forked child shares the rank's start-up environment, whatever it changed since)
    whose environment tells them to use torchrun's agent store."""
    if not _on_agent_store():
        return ()
    own = _read(os.getpid(), "cmdline")
    found = []
    for pid in descendants(os.getpid()):
        command = _read(pid, "cmdline")
        if command and command != own and \
                f"{AGENT_STORE_ENV}=True".encode() in _read(pid, "environ").split(b"\0"):
            words = command.replace(b"\0", b" ").decode(errors="replace").split()
            found.append((pid, " ".join(words)))  # (a -c program's lines on one line)
    return tuple(found)


def _read(pid: int, name: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/{name}").read_bytes()
    except OSError:
        return b""
