"""``nbddp._torchrun --report FD``, as a Ray node's agent starts it: torchrun goes on in a
process of its own, says its exit code on the report pipe, and its node's run dir is
removed whoever ends first (real torchrun, one rank; no Ray needed)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from nbddp._wire.rundir import LIFELINE_ABANDON, LIFELINE_GO, NODE_DISK_ENV, NODE_SHM_ENV

from .conftest import descendants, wait_until

pytestmark = pytest.mark.fast  # the fast lane: bash scripts/test.sh --fast


def start_like_an_agent(tmp_path: Path) -> tuple[Path, int, int]:
    """torchrun on a script that returns at once, started as ``NodeAgent.start`` does:
    the run dir, the lifeline's write end and the report's read end."""
    script = tmp_path / "quick.py"
    script.write_text("print('done')\n")
    run_dir = Path(tempfile.mkdtemp(prefix="nbddp-ray-"))
    read_end, lifeline = os.pipe()
    report, report_write = os.pipe()
    starter = subprocess.Popen(
        [sys.executable, "-m", "nbddp._torchrun", str(run_dir), str(read_end), "--report",
         str(report_write), "--standalone", "--nnodes", "1", "--nproc-per-node", "1",
         str(script)],
        pass_fds=(read_end, report_write), start_new_session=True,
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.close(read_end)
    os.close(report_write)
    starter.wait()  # it went on in a child of its own
    os.write(lifeline, LIFELINE_GO)
    return run_dir, lifeline, report


def read_report(fd: int) -> bytes:
    said = b""
    while chunk := os.read(fd, 64):
        said += chunk
    os.close(fd)
    return said


def test_an_agent_killed_as_torchrun_ends_leaves_no_run_dir(tmp_path):
    """The ranks of a session whose kernel died leave by themselves (they saw it go), and
    Ray kills the agents at the same moment: an agent gone before it cleaned up closes
    torchrun's lifeline, and torchrun, which waited for that, removes the run dir."""
    others = descendants()  # (a test module's Ray cluster, say: not this test's)
    run_dir, lifeline, report = start_like_an_agent(tmp_path)
    assert read_report(report) == b"0"
    assert run_dir.exists()  # torchrun waits for its agent to read its log and clean up
    os.close(lifeline)  # the agent dies without cleaning up
    wait_until(lambda: not run_dir.exists() and not descendants() - others, timeout=30)


def test_an_agent_that_cleans_up_lets_torchrun_go(tmp_path):
    others = descendants()
    run_dir, lifeline, report = start_like_an_agent(tmp_path)
    assert read_report(report) == b"0"
    assert descendants() - others  # still there, waiting for the agent
    shutil.rmtree(run_dir)  # the agent's clean-up: it removes the run dir, then lets go
    os.close(lifeline)
    wait_until(lambda: not descendants() - others, timeout=30)


def start_before_its_folders(tmp_path: Path) -> tuple[Path, list[Path], int, int]:
    """torchrun started as ``NodeAgent.start`` starts it now: before anything is made,
    under the names of the run dir and the node's data folders, which are made while it
    waits for the word; then the run dir, the folders, the lifeline and the report."""
    names = [tmp_path / f"nbddp-{what}-{os.urandom(4).hex()}"
             for what in ("ray", "node", "node")]
    read_end, lifeline = os.pipe()
    report, report_write = os.pipe()
    starter = subprocess.Popen(
        [sys.executable, "-m", "nbddp._torchrun", str(names[0]), str(read_end),
         "--node-data", "--report", str(report_write), "--standalone", "--nnodes", "1",
         "--nproc-per-node", "1", str(tmp_path / "never-run.py")],
        env={**os.environ, NODE_SHM_ENV: str(names[1]), NODE_DISK_ENV: str(names[2])},
        pass_fds=(read_end, report_write), start_new_session=True,
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.close(read_end)
    os.close(report_write)
    starter.wait()  # it went on in a child of its own, which waits for the word
    for name in names:
        name.mkdir(mode=0o700)
    (names[2] / "payload.data").write_bytes(b"x" * 100)
    return names[0], names[1:], lifeline, report


def test_an_agent_killed_before_its_word_leaves_none_of_the_nodes_folders(tmp_path):
    """Ray kills an agent's own children with it, not theirs: killed between making the
    node's folders and saying go, it leaves torchrun, which removes them all."""
    others = descendants()
    run_dir, folders, lifeline, report = start_before_its_folders(tmp_path)
    os.close(lifeline)  # the agent dies before its word
    wait_until(lambda: not run_dir.exists() and not any(f.exists() for f in folders)
               and not descendants() - others, timeout=30)
    assert read_report(report) == b"0"


@pytest.mark.parametrize("after", [0.0, 0.3, 1.0])
def test_an_agent_killed_just_after_its_word_leaves_none_of_the_nodes_folders(
        tmp_path, after):
    """Ray kills an agent (its placement group removed, ``ray.kill``) just after it said
    go, while torchrun is still starting (importing torch, before torch handles SIGTERM
    itself): torchrun stops, and the run dir and the node's folders go with it."""
    others = descendants()
    run_dir, folders, lifeline, report = start_before_its_folders(tmp_path)
    os.write(lifeline, LIFELINE_GO)
    time.sleep(after)
    os.close(lifeline)  # the agent dies just after its word
    wait_until(lambda: not descendants() - others, timeout=30)
    assert not run_dir.exists() and not any(f.exists() for f in folders), \
        {str(path): sorted(p.name for p in path.rglob("*"))
         for path in (run_dir, *folders) if path.exists()}
    read_report(report)  # (whatever it said: it was stopped)


def test_names_someone_took_first_are_left_alone(tmp_path):
    """The folders' names were taken (they show in ``ps``): the agent abandons the start,
    and torchrun ends without removing what is not the agent's."""
    others = descendants()
    run_dir, folders, lifeline, report = start_before_its_folders(tmp_path)
    os.write(lifeline, LIFELINE_ABANDON)
    os.close(lifeline)
    wait_until(lambda: not descendants() - others, timeout=30)
    assert read_report(report) == b"0"
    assert run_dir.exists() and all(folder.exists() for folder in folders)


def agent_without_ray(monkeypatch, tmp_path: Path):
    """A ``NodeAgent`` run as a plain object (its own code; Ray only calls it), its
    node's folders in ``tmp_path``."""
    from nbddp._ray import agent

    monkeypatch.setattr(agent, "_this_node", lambda: {"name": "node-a", "gpus": []})
    monkeypatch.setattr(agent.tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.setattr(agent, "shm_root", lambda: None)
    return agent.NodeAgent(0, outlives_kernel=False)


def start_agent(node) -> str:
    return node.start(b"k" * 32, b"127.0.0.1:1", ["--standalone", "--nnodes", "1",
                                                  "--nproc-per-node", "1"], [], {}, None)


def test_an_agent_whose_names_were_taken_removes_what_it_made_and_ends_torchrun(
        tmp_path, monkeypatch):
    """``NodeAgent.start`` (no Ray: the agent's own code) when someone made one of its
    folders first: the start fails, what the agent made is gone, the other's folder is
    untouched, torchrun has ended, and the agent may start again."""
    from nbddp._ray import agent

    taken = iter([tmp_path / "nbddp-ray-mine", tmp_path / "nbddp-node-theirs"])
    monkeypatch.setattr(agent, "reserved_name", lambda prefix, parent: next(taken))
    theirs = tmp_path / "nbddp-node-theirs"
    theirs.mkdir()
    (theirs / "their.file").write_text("not the agent's")
    others = descendants()
    node = agent_without_ray(monkeypatch, tmp_path)
    with pytest.raises(FileExistsError):
        start_agent(node)
    assert not (tmp_path / "nbddp-ray-mine").exists()
    assert (theirs / "their.file").read_text() == "not the agent's"
    assert node.torchrun_group is None and node.run_dir is None
    wait_until(lambda: not descendants() - others, timeout=30)


def test_an_agent_stopped_before_its_start_starts_nothing(tmp_path, monkeypatch):
    """Ray runs an actor's calls in threads, in no set order: the kernel's stop can come
    before the start it sent first. The start then starts no torchrun and makes nothing
    (the kernel kills the agent right after its stop: a torchrun started then would be
    left to clean up alone)."""
    others = descendants()
    node = agent_without_ray(monkeypatch, tmp_path)
    node.stop()
    with pytest.raises(RuntimeError, match="stopped before torchrun started"):
        start_agent(node)
    assert node.torchrun_group is None and not list(tmp_path.iterdir())
    assert not descendants() - others
