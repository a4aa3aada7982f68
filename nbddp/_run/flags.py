"""How the magics take an option: a ``Flag`` in the metadata of the option's field.

An options dataclass (``RunOptions``, ``Slurm``) is the one place for an option's name,
default, check and help; ``%%ddp`` and ``%ddp_session`` make their flags from it.
Every field says whether a magic takes it: ``flag(...)``, or ``no_flag(why)``. A
flag's parsed value is stored under the field's name (``--no-init`` sets ``init``), so
that the parsed flags are the options' keyword arguments.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass
from typing import Any

_KEY = "flag"


@dataclass(frozen=True)
class Flag:
    """A field's magic flag: what argparse needs, besides the field's name and default."""

    help: str
    """``%%ddp``'s help line (``%%`` shows as ``%``: argparse formats it)."""
    name: str | None = None
    """The flag, when it is not ``--`` and the field's name with dashes."""
    metavar: str | None = None
    type: Callable[[str], Any] | None = None
    """What makes a value of the flag's text (argparse's ``type``)."""
    action: str | None = None
    """argparse's action: ``store_false`` for a flag that turns a default off, ``append``..."""
    const: Any = None
    """The value ``action="store_const"`` stores."""
    value: Callable[[Any], Any] | None = None
    """The option's value from the parsed flag's, where they differ (``"0,2"`` -> ``[0, 2]``);
    it raises ``ValueError`` on text that means nothing."""
    session: str | None = None
    """``%ddp_session``'s help line, for an option a session's ranks start with; None: the
    session magic has no such flag."""

    def option_string(self, field_name: str) -> str:
        return self.name or "--" + field_name.replace("_", "-")


def flag(help: str, **details: Any) -> dict[str, Flag]:
    """A field's metadata: the magics take it as a flag (see ``Flag``)."""
    return {_KEY: Flag(help, **details)}


def no_flag(why: str) -> dict[str, Any]:
    """A field's metadata: no magic takes it, for the reason given."""
    return {_KEY: None, "no_flag": why}


def decided(field: dataclasses.Field) -> bool:
    """Whether the field says if the magics take it (``flag`` or ``no_flag``)."""
    return _KEY in field.metadata


def flagged(options: type, session: bool = False) -> list[tuple[dataclasses.Field, Flag]]:
    """The fields of ``options`` that ``%%ddp`` (or ``%ddp_session``) takes, in order."""
    found = []
    for field in dataclasses.fields(options):
        spec = field.metadata.get(_KEY)
        if spec is not None and (not session or spec.session is not None):
            found.append((field, spec))
    return found


def argparse_arguments(options: type, session: bool = False) -> list[tuple[str, dict[str, Any]]]:
    """``add_argument``'s arguments for each flag of ``options``: the option string, and
    the keywords (the value goes to the field's name, with the field's default)."""
    arguments = []
    given = defaults(options)
    for field, spec in flagged(options, session):
        default = given[field.name]
        keywords: dict[str, Any] = {
            "dest": field.name,
            "help": spec.session if session else spec.help,
            "default": list(default) if spec.action == "append" else default,
        }
        extra = {"metavar": spec.metavar, "type": spec.type, "action": spec.action,
                 "const": spec.const}
        keywords.update({key: value for key, value in extra.items() if value is not None})
        arguments.append((spec.option_string(field.name), keywords))
    return arguments


def flag_values(options: type, parsed: Any, session: bool = False) -> dict[str, Any]:
    """The options' keyword arguments from a parsed magic line (``ValueError`` for a
    flag's text that means nothing)."""
    values = {}
    for field, spec in flagged(options, session):
        value = getattr(parsed, field.name)
        values[field.name] = spec.value(value) if spec.value and value is not None else value
    return values


def defaults(options: type) -> Mapping[str, Any]:
    """Each field's default (those without one left out)."""
    found = {}
    for field in dataclasses.fields(options):
        if field.default is not MISSING:
            found[field.name] = field.default
        elif field.default_factory is not MISSING:
            found[field.name] = field.default_factory()
    return found
