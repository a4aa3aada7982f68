"""Every code example in docs/ runs: the ```python blocks of each page, in order, in one
real Jupyter kernel per page, so ``%load_ext nbddp``, ``%%ddp`` and ``!torchrun`` cells
run as a reader would run them.

A ```python block always runs and must not raise, nor may a ``!command`` in it fail. Text
that is not meant to run uses another fence (```bash, ```text, ```console). Comments on
the line right above a fence make the page check more than that:

- ``<!-- raises: NAME -->`` above a ```python block: the block must fail with the
  exception ``NAME`` (an error page shows the cell as the user writes it);
- ``<!-- output -->`` above a ```text block: the text must appear in what the ```python
  block before it printed, so shown output cannot go stale;
- ``<!-- slurm -->`` above a ```python block: it submits to SLURM, and runs against the
  test cluster (``scripts/slurm-up.sh``, always up in CI); without one it is skipped, and
  so is the rest of the page;
- ``<!-- ray -->`` above a ```python block: it runs on a Ray cluster, a two-node one that
  the test starts on this machine for the page (``RAY_ADDRESS`` names it to the kernel);
  without ray installed it is skipped, and so is the rest of the page.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from .conftest import missing, wait_until
from .kernel_driver import Kernel

pytestmark = pytest.mark.waits  # the waiting lane (tests/conftest.py)

DOCS = Path(__file__).resolve().parent.parent / "docs"
LANGUAGES = {"python", "text", "bash", "console", "toml", "yaml"}
BLOCK_TIMEOUT = 60.0

_FENCE = re.compile(
    r"^(?:<!--\s*(?P<kind>raises|output|slurm|ray)\s*:?\s*(?P<arg>[\w.]*)\s*-->\n)?"
    r"```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^```[ \t]*$",
    re.M | re.S,
)


@dataclass(frozen=True)
class Block:
    lang: str
    body: str
    line: int
    raises: str | None = None
    is_output: bool = False
    needs_slurm: bool = False
    needs_ray: bool = False


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of a page, in order (fences start at the left margin)."""
    text = page.read_text()
    found = []
    for match in _FENCE.finditer(text):
        kind, lang = match["kind"], match["lang"]
        found.append(Block(lang, match["body"], text.count("\n", 0, match.start("lang")) + 1,
                           raises=match["arg"] if kind == "raises" else None,
                           is_output=kind == "output", needs_slurm=kind == "slurm",
                           needs_ray=kind == "ray"))
    return found


def _pages() -> list[Path]:
    return sorted(DOCS.glob("*.md"))


# Pages whose examples another test runs, with checks of its own (and run once, not twice).
RUN_ELSEWHERE = {"frameworks.md": "tests/test_integrations.py"}


def _runnable_pages() -> list[Path]:
    return [page for page in _pages() if any(b.lang == "python" for b in blocks(page))
            and page.name not in RUN_ELSEWHERE]


def _page_params() -> list:
    """Each runnable page; one that submits to SLURM carries the ``slurm`` mark, one that
    runs on Ray the ``ray`` mark."""
    return [pytest.param(page, id=page.stem, marks=[
                *([pytest.mark.slurm] if any(b.needs_slurm for b in blocks(page)) else []),
                *([pytest.mark.ray] if any(b.needs_ray for b in blocks(page)) else [])])
            for page in _runnable_pages()]


def _squeeze(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip("\n").splitlines())


def test_every_fence_is_understood():
    """A typo in a fence (```pyhton, an indented ```python) would silently skip a block."""
    assert _runnable_pages(), f"no ```python blocks found under {DOCS}"
    for page in _pages():
        text = page.read_text()
        found = blocks(page)
        assert text.count("\n```") + text.startswith("```") == 2 * len(found), \
            f"{page.name}: a fence is unbalanced or indented"
        for block in found:
            where = f"{page.name}:{block.line}"
            assert block.lang in LANGUAGES, f"{where}: fence language {block.lang!r}"
            assert block.raises is None or block.lang == "python", where
            assert not block.is_output or block.lang == "text", where
            assert not (block.needs_slurm or block.needs_ray) or block.lang == "python", where
        for number, line in enumerate(text.splitlines(), 1):
            assert not re.match(r"\s+```", line), f"{page.name}:{number}: indented fence"
            if re.search(r"<!--\s*(raises|output|slurm|ray)\b", line):
                following = text.splitlines()[number] if number < len(text.splitlines()) else ""
                assert following.startswith("```"), \
                    f"{page.name}:{number}: a check comment must sit right above its fence"


@pytest.mark.slow
@pytest.mark.parametrize("page", _page_params())
def test_page_examples_run(page: Path, tmp_path: Path, monkeypatch, request):
    # The page's kernel, its runs and any torchrun a page starts by hand (which leaves
    # its log folder behind) use a temp dir of the page's own, with a path short enough
    # for the run dirs' sockets (a longer one puts them in /tmp, where the check below
    # would not see them).
    private_tmp = Path(tempfile.mkdtemp(prefix="docs-", dir="/tmp"))
    request.addfinalizer(lambda: shutil.rmtree(private_tmp, ignore_errors=True))
    monkeypatch.setenv("TMPDIR", str(private_tmp))
    work = tmp_path / "work"
    work.mkdir()
    kernel = Kernel(work)
    clusters: list = []  # a Ray cluster the page runs on, once started
    try:
        _run_page(kernel, page, clusters)
    finally:
        kernel.shutdown()
        for cluster in clusters:
            cluster.stop()
    # Nothing nbddp made for a run is left, whatever the page did.
    wait_until(lambda: not list(private_tmp.glob("nbddp-*")), timeout=10)


def _slurm_ready(kernel: Kernel) -> str | None:
    """Point the kernel at the test cluster; why it cannot be used, or None."""
    from .slurm import load_env, unavailable

    reason = unavailable()
    if reason is None:
        kernel.run(f"import os; os.environ.update({load_env()!r})").assert_ok()
    return reason


def _ray_ready(kernel: Kernel, clusters: list) -> str | None:
    """Start a two-node Ray cluster for the page, and name it to the kernel; why none
    can be started, or None."""
    from .ray_cluster import RayCluster, unavailable

    reason = unavailable()
    if reason is None:
        cluster = RayCluster()
        clusters.append(cluster)
        cluster.start(nodes=2)
        kernel.run(f"import os; os.environ['RAY_ADDRESS'] = {cluster.address!r}").assert_ok()
    return reason


def _run_page(kernel: Kernel, page: Path, clusters: list) -> None:
    previous, slurm_checked, ray_checked = None, False, False
    for block in blocks(page):
        where = f"{page.relative_to(DOCS.parent)}:{block.line}"
        if block.needs_slurm and not slurm_checked:
            slurm_checked = True
            reason = _slurm_ready(kernel)
            if reason:
                missing("slurm", f"{where} and after need SLURM: {reason}")
        if block.needs_ray and not ray_checked:
            ray_checked = True
            reason = _ray_ready(kernel, clusters)
            if reason:
                missing("ray", f"{where} and after need Ray: {reason}")
        if block.lang == "python":
            run = kernel.run(block.body, timeout=BLOCK_TIMEOUT)
            if block.raises:
                _check_raised(run, block.raises, where)
            else:
                assert run.error() is None and "UsageError" not in run.stream_text("stderr"), \
                    f"{where}: the example failed:\n{block.body}\n---\n{run.describe()}"
                _check_shell_commands(kernel, block, run, where)
            previous = run
        elif block.is_output:
            assert previous is not None, f"{where}: <!-- output --> before any python block"
            shown, printed = _squeeze(block.body), _squeeze(previous.stream_text())
            assert shown in printed, (f"{where}: the output shown is not what the example "
                                      f"prints.\nshown:\n{shown}\nprinted:\n{printed}")


def _check_shell_commands(kernel: Kernel, block: Block, run, where: str) -> None:
    """A block that runs a shell command (``!torchrun ...``) must see it succeed: IPython
    reports a failing command only in ``_exit_code``, never as an error."""
    if not re.search(r"^\s*!", block.body, re.M):
        return
    code = kernel.run("print(_exit_code)").stream_text().strip()
    assert code == "0", (f"{where}: the shell command exited with {code}:\n{block.body}"
                         f"\n---\n{run.describe()}")


def _check_raised(run, name: str, where: str) -> None:
    if name == "UsageError":  # IPython prints a magic's usage error; it is no traceback
        assert "UsageError" in run.stream_text("stderr"), \
            f"{where}: expected a UsageError:\n{run.describe()}"
        return
    error = run.error()
    assert error is not None and error["ename"] == name, \
        f"{where}: expected {name}:\n{run.describe()}"
