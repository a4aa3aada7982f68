"""Edited code takes effect on a session's ranks at the next cell, as IPython's
``%autoreload 2`` does it in the notebook: modules imported from files that changed since
are reloaded in place by IPython's own ``superreload`` (functions and classes updated,
instances keep their state and get the new methods).

Only the user's own files are watched, not the standard library or installed packages
(nobody edits those under a running session, and torch alone brings two thousand
modules: looking at all of them before each cell would cost milliseconds). A module is
noted with its file's time when first seen; a later check reloads it if the file is
newer. A module that fails to reload raises ``ReloadFailed`` naming it, before the
cell's code runs; the old module stays (as IPython's does, it is not tried again until
its file changes again). Modules written since the last run (a new file, or a cell's
``%%writefile``) become importable too: ``forget_listings``.
"""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType
from typing import Any

from .._wire.users_code import installed_places, users_file


class ReloadFailed(ImportError):
    """A module the ranks imported from an edited file could not be reloaded."""

    def __init__(self, module: str, path: str, why: str) -> None:
        super().__init__(f"autoreload: module {module!r} ({path}) could not be reloaded, so "
                         f"the ranks keep its old code: {why}")
        self.module, self.path, self.why = module, path, why

    def __reduce__(self) -> tuple[Any, ...]:
        return ReloadFailed, (self.module, self.path, self.why)


class Reloader:
    """The user's modules on this rank, with their files' times when last loaded."""

    def __init__(self) -> None:
        self._watched: dict[str, tuple[str, float]] = {}
        self._seen: set[str] = set()
        self._old_objects: dict[Any, Any] = {}  # superreload's record of replaced objects

    def note_new(self) -> None:
        """Note the modules imported since the last look (and their files' times)."""
        for name in set(sys.modules) - self._seen:
            self._seen.add(name)
            path = users_file(sys.modules.get(name))
            if path is not None:
                mtime = _mtime(path)
                if mtime is not None:
                    self._watched[name] = (path, mtime)

    def check(self) -> None:
        """Reload the user's modules whose files changed. Raises ``ReloadFailed`` for the
        first one that fails."""
        self.note_new()
        for name, (path, loaded) in list(self._watched.items()):
            mtime, module = _mtime(path), sys.modules.get(name)
            if mtime is None or mtime <= loaded or module is None:
                continue
            self._watched[name] = (path, mtime)
            try:
                _superreload(module, self._old_objects)
            except Exception as exc:  # noqa: BLE001 - what the user's module raised, named
                raise ReloadFailed(name, path, f"{type(exc).__name__}: {exc}") from exc


def forget_listings() -> None:
    """Let modules written since the last run be imported: drop the import system's
    listings of the user's folders (``importlib.invalidate_caches`` for those only; a
    folder of installed packages refreshes its own listing when its time changes, and
    going through all of them each run costs a tenth of a millisecond). Which folders
    are the user's is worked out again only when the import system knows new ones."""
    global _users_finders
    known = _users_finders
    cache = sys.path_importer_cache
    seen = _listed(cache)
    if known is None or known[0] != seen:
        known = _users_finders = (seen, _finders_of_users_folders())
    for path, finder in known[1]:
        if cache.get(path) is not finder:  # (replaced since: look again next time)
            _users_finders = None
        finder.invalidate_caches()


_users_finders: tuple[tuple[int, str | None], list[tuple[str, Any]]] | None = None
"""The import system's folders when last looked at (``_listed``), and the finders of
the user's."""


def _listed(cache: dict[str, Any]) -> tuple[int, str | None]:
    """What tells whether the import system knows new folders: how many it knows, and the
    one it met last. (A dict keeps its keys in the order they came, so any folder added
    since is the last one now; comparing every key, several hundred once torch is
    imported, cost a share of each quick run.) Entries the import system drops itself
    (``importlib.invalidate_caches`` drops those of folders that do not exist) can hide
    a new one behind an unchanged count and last key; its finder then still lists the
    folder anew once the folder's time changes, as an installed package's does."""
    return len(cache), next(reversed(cache), None)


def _finders_of_users_folders() -> list[tuple[str, Any]]:
    installed = installed_places()
    return [(path, finder) for path, finder in list(sys.path_importer_cache.items())
            if getattr(finder, "invalidate_caches", None) is not None
            and not path.startswith(installed)]


def _mtime(path: str) -> float | None:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return None


def ready_to_reload() -> None:
    """Import IPython's reloader now (a rank at rest, once autoreload is on): the first
    edit's cell then does not wait for IPython to be imported."""
    import IPython.extensions.autoreload  # noqa: F401


def _superreload(module: ModuleType, old_objects: dict[Any, Any]) -> None:
    """IPython's in-place reload (imported here, or at rest once autoreload is on: a rank
    of a session that never reloads never loads it)."""
    from IPython.extensions.autoreload import superreload

    superreload(module, importlib.reload, old_objects)
