"""What ``%ddp_session auto|autoreload|snapshots on|off`` switch on the open session:
auto mode, the ranks' autoreload, and snapshots of their names."""

from __future__ import annotations

from typing import Any

from IPython.core.error import UsageError

from ._session import Session

SWITCHES = ("auto", "autoreload", "snapshots")


def switched(session: Session | None, switch: str, value: str | None,
             cap: str | None = None) -> Any:
    """Switch ``switch`` ``value`` (on or off) on ``session``, saying so; what the magic
    shows (``cap``: ``--snapshot-max``, with snapshots on)."""
    if switch == "auto":
        return _auto(session, value)
    if switch == "autoreload":
        return _autoreload(session, value)
    return _snapshots(session, value, cap)


def _auto(session: Session | None, value: str | None) -> None:
    if value not in ("on", "off"):
        raise UsageError("%ddp_session auto takes on or off")
    if value == "on" and session is None:
        raise UsageError("auto mode runs every cell on a session's ranks: start one "
                         "first (%ddp_session start --nprocs N)")
    if session is not None:
        session.auto = value == "on"
    print("nbddp session: auto mode " + (
        "on: every cell runs on the session's ranks (cells that begin with % or ! stay "
        "here; %ddp_session auto off ends it)" if value == "on"
        else "off: cells run in the notebook (%%ddp cells on the ranks)"))


def _autoreload(session: Session | None, value: str | None) -> None:
    if value not in (None, "on", "off"):
        raise UsageError("%ddp_session autoreload takes on or off")
    if session is None:
        raise UsageError("autoreload reloads a session's modules: start one first "
                         "(%ddp_session start --nprocs N)")
    session.autoreload = value != "off"
    print("nbddp session: autoreload " + (
        "on: before each cell, the ranks reload the modules you edited (as "
        "%autoreload 2 does here)" if session.autoreload
        else "off: the ranks keep the modules as they imported them"))


def _snapshots(session: Session | None, value: str | None, cap: str | None) -> Any:
    if value not in ("on", "off") or (cap and value == "off"):
        raise UsageError("%ddp_session snapshots takes on (with --snapshot-max SIZE, if "
                         "you like) or off")
    if session is None:
        raise UsageError("snapshots keep a session's names: start one first "
                         "(%ddp_session start --nprocs N)")
    try:
        session.snapshots = (cap or True) if value == "on" else False
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return session.status()
