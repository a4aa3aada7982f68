"""The notebook's own code: the modules and packages it imports from outside the
installed environment, as files that can be shipped to nodes that cannot see them.

A module is the user's when its file is not in the standard library, in an installed
package's folder (site-packages), or in nbddp itself: a module
beside the notebook, in a folder put on ``sys.path``, or an editable install's source
tree (the ranks' autoreload watches the same files: ``_rank.autoreload``). Such a
module is found three ways, because a session's cell may import a module that the
kernel never imported itself:

- it is imported in the kernel (``sys.modules``);
- the code sent by value names it (a cell's ``import`` lines, a function's code);
- a module already found imports it (its source's ``import`` lines, transitively).

A top-level module goes as its one file; a package goes whole: its ``__init__``, its
submodules and the data files inside it (what ``importlib.resources`` would find), not
its ``__pycache__`` nor hidden folders. Finding names again costs the kernel a look at
``sys.modules``' size, a set lookup per name, and one ``stat`` per user folder on
``sys.path``: a name found to be no module of the user's is asked again only once a
folder's listing changed (a file written there may be the module that was missing). A
package's own folders' times say when it gained or lost a file (``OwnModule.again``).
"""

from __future__ import annotations

import functools
import importlib.machinery
import os
import re
import sys
import sysconfig
from dataclasses import dataclass
from types import ModuleType

_NBDDP = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep

#: Top-level names never shipped: the node's image must have them, at the kernel's
#: versions (checked at a session's start), and a copy of one would shadow it.
NEVER_SHIPPED = frozenset({"nbddp", "torch", "cloudpickle", "ray", "__main__"})

#: What a package's folder holds that does not ship: caches, version control, editors'.
_SKIPPED_DIRS = frozenset({"__pycache__", "node_modules"})
_SKIPPED_SUFFIXES = (".pyc", ".pyo", ".swp")

#: A package larger than this does not ship (``PackageTooLarge``): use Ray's
#: ``runtime_env`` (``py_modules``), or install it on the nodes.
MAX_PACKAGE_BYTES = 64 * 2**20

_IMPORT_LINE = re.compile(r"^[ \t]*(?:from[ \t]+([A-Za-z_][\w.]*)[ \t]+import\b"
                          r"|import[ \t]+([A-Za-z_][\w., \t]*))", re.MULTILINE)


class PackageTooLarge(ValueError):
    """A package of the user's own is too large to ship with the cell."""


@functools.cache
def installed_places() -> tuple[str, ...]:
    """Where the standard library, installed packages and nbddp live (folders, each
    ending in the separator): nothing there is the user's own."""
    places = {os.path.abspath(p) + os.sep for key, p in sysconfig.get_paths().items()
              if key in ("stdlib", "platstdlib", "purelib", "platlib")}
    places |= {os.path.abspath(p) + os.sep for p in sys.path
               if p.endswith(("site-packages", "dist-packages"))}
    places.add(_NBDDP)
    return tuple(sorted(places))


def is_users_file(path: str) -> bool:
    """``path`` (absolute) is a Python source file of the user's own."""
    return path.endswith(".py") and not path.startswith(installed_places())


@dataclass(frozen=True)
class OwnModule:
    """A top-level module or package of the user's: ``files`` (paths relative to
    ``root``, the folder it is imported from) are what ships; a package's ``folders``,
    with their times, say when its listing changed."""

    name: str
    root: str
    files: tuple[str, ...]
    folders: tuple[tuple[str, int], ...] = ()

    @functools.cached_property
    def paths(self) -> tuple[str, ...]:
        """Each of ``files``' full path."""
        return tuple(os.path.join(self.root, f) for f in self.files)

    def again(self) -> OwnModule:
        """This module as its folders hold it now: a package whose folders changed is
        listed again (a new submodule or data file ships too)."""
        if not self.folders or all(_mtime(folder) == seen for folder, seen in self.folders):
            return self
        return _package(self.name, os.path.join(self.root, self.name), self.root)


def imported_names(source: str) -> set[str]:
    """The top-level modules ``source``'s ``import`` lines name (relative imports
    aside: a package ships whole). A line in a string counts too: a name too many
    costs a look, never an error."""
    names = set()
    for match in _IMPORT_LINE.finditer(source):
        if match.group(1):
            names.add(match.group(1).split(".")[0])
            continue
        for part in match.group(2).split(","):
            words = part.split()
            if words:
                names.add(words[0].split(".")[0])
    return names


def kernels_modules() -> set[str]:
    """The top-level modules imported in this process from the user's files."""
    global _kernels_seen
    count = len(sys.modules)
    if _kernels_seen is not None and _kernels_seen[0] == count:
        return _kernels_seen[1]
    found = {name for name, module in list(sys.modules.items())
             if "." not in name and name not in NEVER_SHIPPED
             and users_file(module) is not None}
    _kernels_seen = (count, found)
    return found


_kernels_seen: tuple[int, set[str]] | None = None


def users_file(module: ModuleType | None) -> str | None:
    """The user's source file of ``module`` (a package's ``__init__``), if it is one
    (not nbddp's, not installed)."""
    path = getattr(module, "__file__", None)
    if not isinstance(path, str):
        return None
    path = os.path.abspath(path)
    return path if is_users_file(path) else None


class Finder:
    """Finds the user's modules by name, keeping what it found until a user folder on
    ``sys.path`` changes (a file written there may be a module that was missing)."""

    def __init__(self) -> None:
        self._found: dict[str, OwnModule | None] = {}
        self._folders: tuple[tuple[str, int], ...] = ()
        self._path: tuple[tuple[str, ...], str, tuple[str, ...]] | None = None
        """The import path and working directory when last looked at, and the user's
        folders on that path."""

    def may_be(self, name: str) -> bool:
        """``name`` may be the user's: not known not to be."""
        return self._found.get(name, True) is not None

    def find(self, name: str) -> OwnModule | None:
        """The user's module or package ``name``, or None (not the user's, not found)."""
        if name in NEVER_SHIPPED:
            return None
        if name not in self._found:
            self._found[name] = _locate(name)
        return self._found[name]

    def refresh(self) -> None:
        """Forget what was found if a user folder on ``sys.path`` changed since."""
        path, cwd = tuple(sys.path), os.getcwd()
        if self._path is None or self._path[:2] != (path, cwd):
            self._path = (path, cwd, _users_folders(path))
        folders = []
        for folder in self._path[2]:
            try:
                folders.append((folder, os.stat(folder).st_mtime_ns))
            except OSError:
                continue
        if tuple(folders) != self._folders:
            self._folders = tuple(folders)
            self._found = {name: found for name, found in self._found.items() if found}


def _users_folders(path: tuple[str, ...]) -> tuple[str, ...]:
    """The user's folders on the import path ``path`` (the working directory for '')."""
    installed = installed_places()
    folders = (os.path.abspath(entry or os.curdir) for entry in path)
    return tuple(dict.fromkeys(f for f in folders if not (f + os.sep).startswith(installed)))


def _locate(name: str) -> OwnModule | None:
    """Where ``name`` is imported from here: the module loaded, else what the import
    path would find (nothing is imported to find it)."""
    module = sys.modules.get(name)
    origin = users_file(module) if module is not None else None
    if origin is None and module is None:
        try:
            spec = importlib.machinery.PathFinder.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        if spec is not None and isinstance(spec.origin, str):
            path = os.path.abspath(spec.origin)
            origin = path if is_users_file(path) else None
    if origin is None:
        return None
    if os.path.basename(origin) == "__init__.py":
        package = os.path.dirname(origin)
        return _package(name, package, os.path.dirname(package))
    return OwnModule(name, os.path.dirname(origin), (os.path.basename(origin),))


def _package(name: str, package: str, root: str) -> OwnModule:
    """The package ``name`` at ``package``: every file to ship (relative to ``root``),
    sorted, and its folders' times. ``PackageTooLarge`` as soon as it is too large."""
    files, folders, total = [], [], 0
    for folder, dirs, names in os.walk(package):
        dirs[:] = sorted(d for d in dirs if d not in _SKIPPED_DIRS and not d.startswith("."))
        folders.append((folder, _mtime(folder)))
        for file in names:
            if file.startswith(".") or file.endswith(_SKIPPED_SUFFIXES):
                continue
            path = os.path.join(folder, file)
            try:
                total += os.path.getsize(path)
            except OSError:
                continue
            if total > MAX_PACKAGE_BYTES:
                raise PackageTooLarge(
                    f"package {name!r} ({package}) holds more than nbddp ships with a cell "
                    f"({MAX_PACKAGE_BYTES // 2**20} MiB): install it on the nodes, or pass "
                    "it with Ray's runtime_env (py_modules)")
            files.append(os.path.relpath(path, root))
    return OwnModule(name, root, tuple(sorted(files)), tuple(folders))


def _mtime(path: str) -> int:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return -1
