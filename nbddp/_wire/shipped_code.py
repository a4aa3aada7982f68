"""The notebook's own modules, shipped to ranks whose node may not see the notebook's files.

On a cluster people rent, a node has the image, not the folder the notebook sits in, so
``import helpers`` fails there. So the kernel ships the user's own modules
(``_wire.users_code``) to the ranks of a cluster backend with the run's payload, before
anything in it is unpickled, and each node writes them into its private folder (on
local disk, which its torchrun removes: ``_rank.loop.code_home``), under the path they
have in the kernel::

    <node folder>/code/<the kernel's folder, e.g. home/me/project>/helpers.py

Those folders go first on the rank's import path, in the kernel's order, so the rank
imports what the kernel would, whether or not the node sees the original.

Content-addressed, like the data plane's tensors: the kernel keeps, per set of ranks
(``RanksCode``), each file's SHA-256 that every rank holds, and a payload carries only
the files that changed or that those ranks never had; a run that carried files teaches
them once it returned on every rank (``CodeSent``).
The payload crosses once per node, so a file does too. A cell that changed nothing
carries nothing. The kernel looks again at the files of the modules a cell names (a
first import after an edit gets the edit), and with autoreload at every shipped file's
time before a cell (and a package's folders': a new submodule ships): an edit is a new
file on every node, written in place (its old bytecode dropped), which the rank's
autoreload (``_rank.autoreload``) then reloads like a local edit, and what an edited
file newly imports ships with it.
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


@dataclass
class _Seen:
    """A file as last read: its time and size, its SHA-256, and its bytes until every
    rank holds them."""

    mtime_ns: int
    size: int
    digest: str
    data: bytes | None


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
        self._files: tuple[tuple[str, str, str, str], ...] | None = None

    def changes(self, names: Iterable[str], look_at_files: bool) -> ShippedCode | None:
        """What the ranks lack of the user's modules that the kernel imported, that
        ``names`` (the code sent) names, or that were shipped before: the files new to
        them, or edited since, of the modules ``names`` names (a first import, after an
        edit) or, with ``look_at_files`` (autoreload on), of every module; None if
        nothing."""
        self._finder.refresh()
        named = set(names)
        which = self._add(named) | self._add(kernels_modules())
        if look_at_files:
            which |= self._relisted()
        if look_at_files or self._sent is not None:
            which = set(self._modules)
        else:
            which |= named & self._modules.keys()
        files: list[tuple[str, str, str, bytes]] = []
        while which:  # (a file read again may import modules not taken in before)
            before = len(self._modules)
            files += self._unheld(which, look_at_files, named)
            which = set(list(self._modules)[before:])
        if not files:
            self._sent = None
            return None
        self._sent = ShippedCode(tuple(files), self.roots())
        return self._sent

    def _unheld(self, which: set[str], look: bool, named: set[str]
                ) -> list[tuple[str, str, str, bytes]]:
        """The files of the modules ``which`` that the ranks do not hold as they are now
        (looked at again where ``look``, or where the module is ``named``)."""
        unheld = []
        seen_before, held = self._seen, self._held
        for name, root, relative, path in self._every_file():
            if name not in which:
                continue
            seen = seen_before.get(path)
            if seen is None or look or name in named:
                seen = self._read(path, seen)
            if seen is not None and held.get(path) != seen.digest:
                unheld.append((root, relative, seen.digest, self._bytes_of(path, seen)))
        return unheld

    def _every_file(self) -> tuple[tuple[str, str, str, str], ...]:
        """Every file of the modules, with its module's name, root, path under it and
        full path: listed again only when the modules changed."""
        if self._files is None:
            self._files = tuple((module.name, module.root, relative, path)
                                for module in self._modules.values()
                                for relative, path in zip(module.files, module.paths,
                                                          strict=True))
        return self._files

    def _relisted(self) -> set[str]:
        """The packages whose folders changed, listed again (a new submodule, a data
        file): their names."""
        relisted = set()
        for name, module in list(self._modules.items()):
            if not module.folders:
                continue
            try:
                again = module.again()
            except PackageTooLarge as exc:
                warnings.warn(f"nbddp: {exc}", stacklevel=4)
                continue
            if again is not module:
                self._modules[name], self._files = again, None
                relisted.add(name)
        return relisted

    def roots(self) -> tuple[str, ...]:
        """The folders the shipped modules are imported from, in the kernel's order
        (one that is not on its import path, an editable install's, first)."""
        where: dict[str, int] = {}
        for index, entry in enumerate(sys.path):
            where.setdefault(os.path.abspath(entry or os.curdir), index)
        return tuple(sorted({m.root for m in self._modules.values()},
                            key=lambda root: where.get(root, -1)))

    def _add(self, names: Iterable[str]) -> set[str]:
        """Take in the user's modules among ``names`` and what they import; the names
        of those that were new."""
        added = set()
        todo = [n for n in names if n not in self._modules and n not in self._refused
                and self._finder.may_be(n)]
        while todo:
            name = todo.pop()
            if name in self._modules or name in self._refused:
                continue
            module = self._find(name)
            if module is None:
                continue
            self._modules[name], self._files = module, None
            added.add(name)
            for path in module.paths:
                if path.endswith(".py"):
                    todo.extend(n for n in _imports_of(path) if n not in self._modules)
        return added

    def _find(self, name: str) -> OwnModule | None:
        try:
            return self._finder.find(name)
        except PackageTooLarge as exc:
            self._refused.add(name)
            warnings.warn(f"nbddp: {exc}", stacklevel=5)
            return None

    def _read(self, path: str, seen: _Seen | None) -> _Seen | None:
        """The file as it is now: ``seen`` (as it was last read) if its time and size
        are the same, else read again; a module's file read again may import more of
        the user's modules, which are taken in."""
        try:
            st = os.stat(path)
        except OSError:
            return seen
        if seen is not None and seen.mtime_ns == st.st_mtime_ns and seen.size == st.st_size:
            return seen
        try:
            data = _bytes(path)
        except OSError:
            return seen
        digest = hashlib.sha256(data).hexdigest()
        if seen is not None and path.endswith(".py") and digest != seen.digest:
            self._add(imported_names(data.decode("utf-8", "replace")))
        seen = self._seen[path] = _Seen(st.st_mtime_ns, st.st_size, digest, data)
        return seen

    @staticmethod
    def _bytes_of(path: str, seen: _Seen) -> bytes:
        """The bytes ``seen`` has; read again where they were let go (they had been
        taught, and these ranks were since replaced in part)."""
        return seen.data if seen.data is not None else _bytes(path)

    def taught(self, code: ShippedCode) -> None:
        """Every rank took a payload carrying ``code``: they hold those files (whose
        bytes the kernel lets go)."""
        for root, relative, digest, _ in code.files:
            path = os.path.join(root, relative)
            self._held[path] = digest
            seen = self._seen.get(path)
            if seen is not None and seen.digest == digest:
                seen.data = None
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


def install(code: ShippedCode, home: Path | None = None) -> None:
    """Write ``code``'s files into ``home``'s folder for them (the node's), and put
    their folders first on the import path, in the kernel's order: the rank imports
    what the kernel would."""
    base = _code_folder(home)
    _write_files(base, code.files)
    mirrors = [str(base / root.lstrip(os.sep)) for root in code.roots]
    for mirror in reversed(mirrors):
        if mirror in sys.path:
            sys.path.remove(mirror)
        sys.path.insert(0, mirror)
    for key in [k for k in sys.path_importer_cache if k.startswith(tuple(mirrors))]:
        finder = sys.path_importer_cache.get(key)
        if finder is not None and hasattr(finder, "invalidate_caches"):
            finder.invalidate_caches()  # (a folder listed before a file was written)


def _write_files(base: Path, files: Iterable[tuple[str, str, str, bytes]]) -> None:
    """Each file under ``base``, at its kernel path; one whose bytes are already there
    (written by another rank of the node) is left as it is. A path that would leave
    ``base`` is refused (it can come only from the kernel, which holds the run's key)."""
    for root, relative, digest, data in files:
        target = base / root.lstrip(os.sep) / relative
        if _installed.get(str(target)) == digest:
            continue
        if not os.path.normpath(target).startswith(str(base) + os.sep):
            raise ValueError(f"nbddp: a shipped file's path leaves the code folder: {target}")
        _write_if_changed(target, data)
        _installed[str(target)] = digest


def _code_folder(home: Path | None) -> Path:
    """The folder for shipped code in ``home`` (the node's private folder, which its
    torchrun removes, or the rank's run folder, which goes with the run); in a new
    temporary folder without one (a payload unpacked outside a rank)."""
    return (home or Path(tempfile.mkdtemp(prefix="nbddp-code-"))) / CODE_FOLDER


def _write_if_changed(target: Path, data: bytes) -> None:
    """``data`` at ``target``, atomically, unless it holds those bytes already. An older
    version's bytecode goes first (its header keeps the source's time in whole seconds
    and its size only: an edit within a second, of the same size, would not be seen)."""
    try:
        if target.read_bytes() == data:
            return
    except OSError:
        pass
    target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    if target.suffix == ".py":
        cache = target.parent / "__pycache__"
        for compiled in cache.glob(f"{target.stem}.*.pyc") if cache.is_dir() else ():
            with contextlib.suppress(OSError):
                compiled.unlink()
    temporary = target.with_name(f".{target.name}.{secrets.token_hex(4)}")
    with open(temporary, "wb") as f:
        f.write(data)
    os.replace(temporary, target)
