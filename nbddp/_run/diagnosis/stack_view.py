"""How a rank's stacks read: like a Python traceback, the user's code first.

A rank's dump is ``faulthandler``'s (``_wire/stacks.py``): every thread, most recent call
first, a file, a line number and a function per frame, nbddp's own threads and frames
mixed in. Read at 2 a.m. that hides the one line that matters. Here a dump becomes:

- a summary line per rank, e.g. ``rank 0: waiting in barrier (Cell In[3], line 9)``;
- the main thread most recent call last, each frame with its source line, as Python and
  IPython print a traceback (cells named as the notebook names them);
- torch's internals folded into one line; nbddp's frames, ``runpy``'s and importlib's
  left out, and so are nbddp's own threads (the channel, the reporter).

``full=True`` keeps every frame and every thread. The kernel renders, not the rank: it
has the cells' sources in its ``linecache``, and the files are on its disk (or the
cluster's shared one).
"""

from __future__ import annotations

import enum
import functools
import importlib.util
import linecache
import os
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from ..._errors import cell_name, name_cells

_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+)", re.MULTILINE)
_FRAME = re.compile(r'^\s*File "(?P<file>.*)", line (?P<line>\d+|\?\?\?) in (?P<function>.*)$')
_FROZEN = re.compile(r"<frozen (.+)>")
_PACKAGES = re.compile(r"[/\\](?:site|dist)-packages[/\\](?P<top>[^/\\]+)")
_MACHINERY = {"runpy", "importlib._bootstrap", "importlib._bootstrap_external"}
"""Modules that only start the rank's code (frozen in Python 3.11+, files before)."""


class Kind(enum.Enum):
    """Whose code a frame runs, which decides how it is shown."""

    OWN = "own"  # the user's: cells and files outside any installed package
    LIBRARY = "library"  # an installed package, or the standard library: shown
    TORCH = "torch"  # folded into one line
    NBDDP = "nbddp"  # left out
    MACHINERY = "machinery"  # runpy, importlib's bootstrap: left out


@dataclass(frozen=True)
class Frame:
    file: str
    line: int | None
    function: str

    @functools.cached_property
    def kind(self) -> Kind:
        return _kind_of(self.file)

    @property
    def package(self) -> str:
        """The top-level package or module the frame is in (``torch``, ``threading``)."""
        frozen = _FROZEN.fullmatch(self.file)
        if frozen:
            return frozen.group(1)
        installed = _PACKAGES.search(self.file)
        if installed:
            return Path(installed.group("top")).stem
        return "nbddp" if self.kind is Kind.NBDDP else Path(self.file).stem

    def place(self) -> str:
        """``Cell In[3], line 9`` or ``train.py, line 12``."""
        return f"{cell_name(self.file) or Path(self.file).name}, line {self.line or '?'}"

    def lines(self) -> list[str]:
        """The frame as a traceback prints it: where, then the source line if known."""
        head = f'  File "{self.file}", line {self.line or "???"}, in {self.function}'
        source = linecache.getline(self.file, self.line).strip() if self.line else ""
        return [head, f"    {source}"] if source else [head]


@dataclass(frozen=True)
class Thread:
    ident: str
    frames: tuple[Frame, ...]
    """Outermost first, as a traceback lists them."""
    notes: tuple[str, ...] = ()
    """faulthandler's lines that are no frame (``<no Python frame>``, ``...``)."""

    @property
    def nbddps_own(self) -> bool:
        """A thread nbddp started (the channel's listener, the reporter): nbddp's frames
        and the standard library's, nothing of the user's or of a framework's."""
        kinds = {frame.kind for frame in self.frames}
        return Kind.NBDDP in kinds and all(
            frame.kind is not Kind.OWN and (frame.kind is not Kind.LIBRARY or _in_stdlib(
                frame.file)) for frame in self.frames)


def render(rank: int, dump: str, main: str | None, full: bool = False) -> str:
    """A rank's dump as a person reads it: the summary line, the main thread, then the
    other threads (the user's and the frameworks'; with ``full``, every thread, every
    frame)."""
    threads = parse(dump, main)
    if not threads:
        return f"rank {rank}: no Python stack\n{dump.strip()}"
    first, *others = threads
    main_found = main is not None and first.ident == main
    blocks = [_block("Main thread" if main_found else f"Thread {first.ident}", first, full)]
    blocks += [_block(f"Thread {thread.ident}", thread, full) for thread in others
               if full or not thread.nbddps_own]
    said = summary(rank, first) if main_found or main is None else \
        f"rank {rank}: its main thread's stack did not come (the other threads follow)"
    return name_cells(f"{said}\n" + "\n\n".join(blocks))


def parse(dump: str, main: str | None) -> list[Thread]:
    """The threads in a faulthandler dump, the main one (``main``) first."""
    threads = [_thread(block) for block in _split(dump)]
    return sorted(threads, key=lambda thread: thread.ident != main)


def summary(rank: int, thread: Thread) -> str:
    """One line: what the rank is doing and the user's line that led there, e.g.
    ``rank 0: waiting in barrier (Cell In[3], line 9)``."""
    if not thread.frames:
        return f"rank {rank}: not in Python code"
    innermost = thread.frames[-1]
    own = [frame for frame in thread.frames if frame.kind is Kind.OWN]
    if not own:
        ours = [frame for frame in thread.frames if frame.kind is Kind.NBDDP]
        doing = f"in nbddp's {ours[-1].function}" if ours else _doing(thread.frames)
        return f"rank {rank}: {doing}, not in the user's code"
    if own[-1] is innermost:
        return f"rank {rank}: in {innermost.function} ({innermost.place()})"
    called = thread.frames[thread.frames.index(own[-1]) + 1]
    return f"rank {rank}: {_doing(thread.frames, called)} ({own[-1].place()})"


def where(stacks: dict[int, str], report: str = "") -> str:
    """Where each rank was: the summary lines, the hang report (``hang_report``), then
    each rank's main thread (as ``render`` shows them; ``Job.stacks`` has every thread)."""
    parts = ["where each rank was:"]
    parts += [summary_of(text) for _, text in sorted(stacks.items())]
    parts += [report] if report else []
    for rank, text in sorted(stacks.items()):
        main = text.split("\n", 1)[1].split("\n\n", 1)[0] if "\n" in text else ""
        parts.append(f"--- rank {rank} ---\n{main}")
    return "\n".join(parts)


def summary_of(text: str) -> str:
    """The summary line of a rank's stacks as ``render`` shows them."""
    return text.split("\n", 1)[0]


def _doing(frames: tuple[Frame, ...], called: Frame | None = None) -> str:
    """``waiting in barrier`` (a collective, however deep: torch.distributed's innermost
    public function, ``init_process_group`` rather than its helpers), else the library
    function the user's code called (``in backward (torch)``), or the innermost frame."""
    innermost = frames[-1]
    if _in_distributed(innermost):
        public = [frame.function for frame in frames
                  if _in_distributed(frame) and _public(frame.function)]
        return f"waiting in {public[-1] if public else innermost.function}"
    frame = called or innermost
    return f"in {frame.function} ({frame.package})"


def _in_distributed(frame: Frame) -> bool:
    return frame.kind is Kind.TORCH and bool(
        re.search(r"[/\\]torch[/\\]distributed[/\\]", frame.file))


def _public(function: str) -> bool:
    """A function a user calls, not a helper or a decorator's wrapper."""
    return not function.startswith(("_", "<")) and function not in _WRAPPERS


_WRAPPERS = {"wrapper", "inner", "wrapped", "decorator", "fn", "func"}


def _block(title: str, thread: Thread, full: bool) -> str:
    lines = [f"{title} (most recent call last):"]
    folded: list[Frame] = []
    for frame in thread.frames:
        if not full and frame.kind in (Kind.NBDDP, Kind.MACHINERY):
            continue  # (left out, also between torch's frames: importing torch nests so)
        if not full and frame.kind is Kind.TORCH:
            folded.append(frame)
            continue
        lines += _folded(folded)
        folded = []
        lines += frame.lines()
    lines += _folded(folded)
    if len(lines) == 1 and thread.frames:
        lines.append("  (only nbddp's frames: job.stacks(full=True) shows them)")
    notes = [f"  {note}" for note in thread.notes]  # (faulthandler's "..." cuts the
    return "\n".join(lines[:1] + notes + lines[1:])  # outermost frames: first here)


def _folded(frames: list[Frame]) -> list[str]:
    if not frames:
        return []
    functions = [frame.function for frame in frames]
    names = " > ".join(functions if len(functions) <= 3 else [*functions[:2], "...",
                                                              functions[-1]])
    many = f"{len(frames)} frames" if len(frames) > 1 else "1 frame"
    return [f"  [{many} in torch: {names}]"]


def _split(dump: str) -> list[str]:
    starts = [match.start() for match in _THREAD.finditer(dump)]
    return [dump[a:b] for a, b in zip(starts, [*starts[1:], len(dump)], strict=True)]


def _thread(block: str) -> Thread:
    head, *body = block.strip("\n").splitlines()
    match = _THREAD.match(head)
    assert match is not None  # (``_split`` cut the dump at these heads)
    frames, notes = [], []
    for line in body:
        frame = _FRAME.match(line)
        if frame is None:
            if line.strip():
                notes.append(line.strip())
            continue
        number = frame.group("line")
        frames.append(Frame(frame.group("file"), int(number) if number.isdigit() else None,
                            frame.group("function")))
    return Thread(match.group(2), tuple(reversed(frames)), tuple(notes))


def _kind_of(file: str) -> Kind:
    frozen = _FROZEN.fullmatch(file)
    if frozen:
        return Kind.MACHINERY if frozen.group(1) in _MACHINERY else Kind.LIBRARY
    installed = _PACKAGES.search(file)
    top = installed.group("top") if installed else None
    if top == "nbddp" or _under(file, _package_dir("nbddp")):
        return Kind.NBDDP
    if top == "torch" or _under(file, _package_dir("torch")):
        return Kind.TORCH
    if installed:
        return Kind.LIBRARY
    if _in_stdlib(file):
        return Kind.MACHINERY if Path(file).stem in _MACHINERY else Kind.LIBRARY
    return Kind.OWN


def _in_stdlib(file: str) -> bool:
    return file.startswith("<frozen ") or (
        _under(file, _stdlib_dir()) and not _PACKAGES.search(file))


def _under(file: str, folder: str | None) -> bool:
    return folder is not None and file.startswith(folder + os.sep)


@functools.cache
def _stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


@functools.cache
def _package_dir(name: str) -> str | None:
    """Where the kernel's ``name`` is installed (an editable checkout too), without
    importing it; ranks on a cluster share it through the shared filesystem."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    places = list(spec.submodule_search_locations or []) if spec is not None else []
    return str(Path(places[0]).resolve()) if places else None
