"""The notebook's own modules, shipped to ranks whose node may not see the notebook's files.

On a cluster people rent, a node has the image, not the folder the notebook sits in, so
``import helpers`` fails there. So the kernel ships the user's own modules
(``_wire.users_code``) to the ranks of a cluster backend with the run's payload, before
anything in it is unpickled, and each node writes them into its private folder (its
shared memory, ``NBDDP_NODE_SHM``), under the path they have in the kernel::

    <node folder>/code/<the kernel's folder, e.g. home/me/project>/helpers.py

That folder goes on the rank's import path just before the kernel's own folder, so the
rank imports what the kernel has, whether or not the node sees the original.

Content-addressed, like the data plane's tensors: the kernel keeps, per set of ranks
(``RanksCode``), each file's SHA-256 that every rank holds, and a payload carries only
the files that changed or that those ranks never had; a run that carried files teaches
them once it returned on every rank (``CodeSent``), as held functions are taught.
The payload crosses once per node, so a file does too. A cell that changed nothing
carries nothing. With autoreload, the kernel looks at each shipped file's time before a
cell: an edit is a new file on every node, written in place (its old bytecode dropped),
which the rank's autoreload (``_rank.autoreload``) then reloads like a local edit.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import sys
import tempfile
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from .rundir import NODE_DISK_ENV, NODE_SHM_ENV
from .users_code import Finder, OwnModule, PackageTooLarge, imported_names, kernels_modules

CODE_FOLDER = "code"
"""The node folder's sub-folder for shipped code."""
SHIP_ENV = "NBDDP_SHIP_CODE"
"""``0`` in the kernel's environment: the user's modules do not ship (every node sees the
notebook's files); read at each run."""


def wanted() -> bool:
    """Whether the user's modules ship with the next run (``SHIP_ENV``)."""
    return os.environ.get(SHIP_ENV) != "0"


@dataclass(frozen=True)
class ShippedCode:
    """Files of the user's modules for the ranks: each as the kernel folder (``root``)
    it is imported from, its path under it, its SHA-256, and its bytes."""

    files: tuple[tuple[str, str, str, bytes], ...]
    roots: tuple[str, ...]
    """Every folder the ranks import the user's code from, in the kernel's order."""

    @property
    def size(self) -> int:
        return sum(len(data) for *_, data in self.files)


@dataclass
class _Seen:
    """A file as last read: its time and size, its bytes and their SHA-256."""

    mtime_ns: int
    size: int
    data: bytes
    digest: str


class RanksCode:
    """(In the kernel) The user's modules one set of ranks was sent, and which version
    of each file every one of them holds."""

    def __init__(self) -> None:
        self._finder = Finder()
        self._modules: dict[str, OwnModule] = {}
        """Every module shipped to these ranks (or about to be), by name."""
        self._held: dict[str, str] = {}
        """Each file's SHA-256 that every rank holds, by its path in the kernel."""
        self._seen: dict[str, _Seen] = {}
        self._refused: set[str] = set()
        self._sent: ShippedCode | None = None
        """The last files sent that the ranks are not yet known to hold."""
        self._files: list[tuple[str, str, str]] = []
        """Every file of the modules: its root, its path under it, and its full path."""

    def changes(self, names: Iterable[str], look_at_files: bool) -> ShippedCode | None:
        """What the ranks lack of the user's modules that the kernel imported, that
        ``names`` (the code sent) names, or that were shipped before: the files new to
        them, or (``look_at_files``: autoreload is on) edited since; None if nothing."""
        self._finder.refresh()
        grew = self._add(names) | self._add(kernels_modules())
        if not grew and not look_at_files and self._sent is None:
            return None
        files = []
        seen_before, held = self._seen, self._held
        for root, relative, path in self._files:
            seen = seen_before.get(path)
            if seen is None or look_at_files:
                seen = self._read(path, seen)
            if seen is not None and held.get(path) != seen.digest:
                files.append((root, relative, seen.digest, seen.data))
        if not files:
            self._sent = None
            return None
        self._sent = ShippedCode(tuple(files), self.roots())
        return self._sent

    def roots(self) -> tuple[str, ...]:
        """The folders the shipped modules are imported from, in the kernel's order
        (one that is not on its import path, an editable install's, first)."""
        where: dict[str, int] = {}
        for index, entry in enumerate(sys.path):
            where.setdefault(os.path.abspath(entry or os.curdir), index)
        return tuple(sorted({m.root for m in self._modules.values()},
                            key=lambda root: where.get(root, -1)))

    def _add(self, names: Iterable[str]) -> bool:
        """Take in the user's modules among ``names`` and what they import; whether any
        was new."""
        grew = False
        todo = [n for n in names if n not in self._modules and n not in self._refused
                and self._finder.may_be(n)]
        while todo:
            name = todo.pop()
            if name in self._modules or name in self._refused:
                continue
            module = self._find(name)
            if module is None:
                continue
            self._modules[name] = module
            self._files.extend((module.root, relative, path)
                               for relative, path in zip(module.files, module.paths(),
                                                         strict=True))
            grew = True
            for path in module.paths():
                if path.endswith(".py"):
                    todo.extend(n for n in _imports_of(path) if n not in self._modules)
        return grew

    def _find(self, name: str) -> OwnModule | None:
        try:
            return self._finder.find(name)
        except PackageTooLarge as exc:
            self._refused.add(name)
            warnings.warn(f"nbddp: {exc}", stacklevel=4)
            return None

    def _read(self, path: str, seen: _Seen | None) -> _Seen | None:
        """The file as it is now: ``seen`` (as it was last read) if its time and size
        are the same, else read again."""
        try:
            st = os.stat(path)
        except OSError:
            return seen
        if seen is None or seen.mtime_ns != st.st_mtime_ns or seen.size != st.st_size:
            try:
                data = _bytes(path)
            except OSError:
                return seen
            seen = self._seen[path] = _Seen(st.st_mtime_ns, st.st_size, data,
                                            hashlib.sha256(data).hexdigest())
        return seen

    def taught(self, code: ShippedCode) -> None:
        """Every rank took a payload carrying ``code``: they hold those files."""
        for root, relative, digest, _ in code.files:
            self._held[os.path.join(root, relative)] = digest
        if code is self._sent:
            self._sent = None


@dataclass(frozen=True)
class CodeSent:
    """The user's files one payload carries (None: none), and the ranks they were
    chosen for; kept until the run's end, which confirms them if every rank took it."""

    ranks: RanksCode
    code: ShippedCode | None

    def confirm(self) -> None:
        if self.code is not None:
            self.ranks.taught(self.code)


def _bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _imports_of(path: str) -> set[str]:
    try:
        return imported_names(_bytes(path).decode("utf-8", "replace"))
    except OSError:
        return set()


# --- on the rank ----------------------------------------------------------------------

_installed: dict[str, str] = {}
"""(On a rank) The SHA-256 of each file this rank wrote or found, by its path here."""
_own_folder: list[Path] = []


def install(code: ShippedCode) -> None:
    """Write ``code``'s files into this node's folder (one whose bytes are already there,
    written by another rank of the node, is left as it is), and put their folders on
    the import path before the kernel's own."""
    base = _code_folder()
    touched = set()
    for root, relative, digest, data in code.files:
        target = base / root.lstrip(os.sep) / relative
        if _installed.get(str(target)) != digest:
            _write_if_changed(target, data)
            _installed[str(target)] = digest
        touched.add(str(base / root.lstrip(os.sep)))
    for root in reversed(code.roots):
        mirror = str(base / root.lstrip(os.sep))
        if mirror not in sys.path:
            where = sys.path.index(root) if root in sys.path else 0
            sys.path.insert(where, mirror)
    for key in [k for k in sys.path_importer_cache if k.startswith(tuple(touched))]:
        finder = sys.path_importer_cache.get(key)
        if finder is not None and hasattr(finder, "invalidate_caches"):
            finder.invalidate_caches()


def _code_folder() -> Path:
    """This node's folder for shipped code: in the node's private shared-memory (or
    local disk) folder, which its torchrun removes; else one of this process's own."""
    node = os.environ.get(NODE_SHM_ENV) or os.environ.get(NODE_DISK_ENV)
    if node:
        return Path(node) / CODE_FOLDER
    if not _own_folder:
        _own_folder.append(Path(tempfile.mkdtemp(prefix="nbddp-code-")))
        import atexit
        import shutil

        atexit.register(shutil.rmtree, _own_folder[0], True)
    return _own_folder[0]


def _write_if_changed(target: Path, data: bytes) -> None:
    """``data`` at ``target``, atomically, unless it holds those bytes already; an
    older version's bytecode goes (its header keeps the source's time in whole seconds
    and its size only: an edit within a second, of the same size, would not be seen)."""
    try:
        if target.read_bytes() == data:
            return
    except OSError:
        pass
    target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    temporary = target.with_name(f".{target.name}.{secrets.token_hex(4)}")
    with open(temporary, "wb") as f:
        f.write(data)
    os.replace(temporary, target)
    if target.suffix == ".py":
        cache = target.parent / "__pycache__"
        for compiled in cache.glob(f"{target.stem}.*.pyc") if cache.is_dir() else ():
            with contextlib.suppress(OSError):
                compiled.unlink()
