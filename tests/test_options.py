"""The run options have one home: ``RunOptions`` (and ``Slurm`` for a SLURM job's).

``launch``, ``Session`` and ``export`` spell the options out in their signatures for
users and IDEs; these tests pin those signatures to the dataclasses' fields (names and
defaults), and check that the magics' flags, made from the fields, cover every option
a magic should take. Pure logic: no process starts.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
import typing
from typing import Any

import pytest
from IPython.core.error import UsageError
from IPython.core.magic_arguments import parse_argstring

from nbddp._export.script import export
from nbddp._launch import launch
from nbddp._magic import DDPMagics, _usage_error, _values
from nbddp._ray.options import Ray
from nbddp._run.config import ConfigPerRun, RunConfig, RunOptions
from nbddp._run.devices import GpusNotVisible
from nbddp._run.flags import decided, defaults, flagged
from nbddp._session import Session
from nbddp._slurm.options import Slurm, SlurmOptions

pytestmark = pytest.mark.fast  # the fast lane: bash scripts/test.sh --fast

MAGIC_ONLY = {"help", "out", "export", "slurm", "ray", "nodes", "ranks", "auto_cell"}
"""``%%ddp``'s own flags, which are no option of a run: help, names to bring back,
exporting instead of running, a cluster's word (submitting to SLURM, running on Ray),
and its nodes."""
EXPORT_RENAMED = {"gpus": (SlurmOptions, "gpus_per_node")}
"""export's ``gpus`` counts GPUs per node (0: none), as a SLURM job's shape does."""


def _parameters(function: Any, leave_out: set[str]) -> dict[str, Any]:
    """A signature's keyword parameters and their defaults."""
    return {name: parameter.default
            for name, parameter in inspect.signature(function).parameters.items()
            if name not in leave_out}


def _dests(parser: Any) -> set[str]:
    return {action.dest for action in parser._actions}


# --- the signatures are pinned to the fields --------------------------------------------


def test_launch_takes_every_run_option_with_its_default():
    taken = _parameters(launch, {"fn", "args", "kwargs", "wait", "cluster", "slurm", "ray"})
    assert taken == dict(defaults(RunOptions))


@pytest.mark.skipif(sys.version_info < (3, 11), reason="typing.get_overloads is 3.11+")
def test_launch_overloads_have_the_implementations_parameters():
    overloads = typing.get_overloads(launch)
    assert len(overloads) == 3
    names = list(inspect.signature(launch).parameters)
    for overload in overloads:
        assert list(inspect.signature(overload).parameters) == names


def test_session_takes_run_options_with_their_defaults():
    started = _parameters(Session.__init__, {"self", "cluster", "slurm", "grace", "ray",
                                             "snapshots"})  # (a session's own)
    assert started.items() <= dict(defaults(RunOptions)).items()
    for cluster in ("cluster", "slurm", "ray"):
        assert _parameters(launch, set())[cluster] == \
            _parameters(Session.__init__, set())[cluster]
    per_run = _parameters(Session.submit, {"self", "fn", "args", "kwargs", "stdout",
                                           "timeout", "output",  # None: the session's
                                           "ranks"})  # (a session's alone)
    assert per_run.items() <= dict(defaults(RunOptions)).items()
    assert set(per_run) == {"all_ranks", "stall_after", "pdb"}


def test_export_takes_run_and_slurm_options_with_their_defaults():
    slurm_fields = {field.name for field in dataclasses.fields(Slurm)}
    for name, default in _parameters(export, {"fn", "path", "args", "kwargs"}).items():
        if name == "nodes":  # (the magics' own --nodes)
            assert default == defaults(Slurm)["nodes"]
            continue
        owner, field = EXPORT_RENAMED.get(
            name, (Slurm if name in slurm_fields else RunOptions, name))
        assert field in defaults(owner), f"export's {name} is no option of {owner.__name__}"
        assert default == defaults(owner)[field], f"export's {name}"


def test_slurm_and_the_sbatch_options_agree_on_defaults():
    ours, written = defaults(Slurm), defaults(SlurmOptions)
    for name in ours.keys() & written.keys():
        assert ours[name] == written[name], name
    assert ours["max_restarts"] == defaults(RunOptions)["max_restarts"]


# --- the magics' flags are the fields' --------------------------------------------------


def test_every_option_says_whether_a_magic_takes_it():
    for options in (RunOptions, Slurm, Ray):
        undecided = [field.name for field in dataclasses.fields(options) if not decided(field)]
        assert undecided == [], f"{options.__name__}: flag(...) or no_flag(why) for these"


def test_ddp_has_a_flag_for_every_option_a_cell_can_take_and_no_other():
    parser = DDPMagics.ddp.parser
    wanted = {field.name for options in (RunOptions, Slurm, Ray)
              for field, _ in flagged(options)}
    assert _dests(parser) == wanted | MAGIC_ONLY
    assert {"gpus", "nprocs", "backend", "timeout", "init", "max_restarts", "stall_after",
            "output", "nodes", "time", "partition", "cpus_per_task", "sbatch", "requeue",
            "signal_before"} <= wanted | MAGIC_ONLY  # those %%ddp has always had


def test_ddp_session_has_a_flag_for_every_option_a_session_starts_with():
    parser = DDPMagics.ddp_session.parser
    job = {field.name for options in (Slurm, Ray) for field, _ in flagged(options)}
    options = _dests(parser) - {"help", "action", "job", "slurm", "ray", "nodes", "grace",
                                "snapshots", "snapshot_max"} - job
    assert options == {field.name for field, _ in flagged(RunOptions, session=True)}
    assert options == {"gpus", "nprocs", "backend", "timeout", "init"}
    assert options <= set(_parameters(Session.__init__, {"self"}))
    assert job <= _dests(parser) and "slurm" in _dests(parser)  # as %%ddp --slurm spells them
    assert "grace" in _parameters(Session.__init__, {"self"})
    assert "snapshots" in _parameters(Session.__init__, {"self"})  # (--snapshots: start's)


def test_no_flags_give_the_defaults():
    args = parse_argstring(DDPMagics.ddp, "")
    assert RunOptions(**_values(RunOptions, args)) == RunOptions()
    assert Slurm(**_values(Slurm, args)) == Slurm()
    session_args = parse_argstring(DDPMagics.ddp_session, "start")
    assert RunOptions(**_values(RunOptions, session_args, session=True)) == RunOptions()


def test_each_flag_sets_its_option():
    args = parse_argstring(DDPMagics.ddp, (
        "--gpus 0,2 --nprocs 2 --backend gloo --timeout 5 --no-init --max-restarts 1 "
        "--stall-after 0 --all-ranks --nodes 2 --time 01:00:00 --partition p "
        "--cpus-per-task 8 --sbatch=--account=a --sbatch=--qos=q --requeue "
        "--signal-before 60"))
    assert RunOptions(**_values(RunOptions, args)) == RunOptions(
        gpus=[0, 2], nprocs=2, backend="gloo", timeout=5.0, init=False, max_restarts=1,
        stall_after=None, output="all")
    assert Slurm(nodes=args.nodes, **_values(Slurm, args)) == Slurm(
        nodes=2, time="01:00:00", partition="p", cpus_per_task=8,
        sbatch=("--account=a", "--qos=q"), requeue=True, signal_before=60)
    assert _values(RunOptions, parse_argstring(DDPMagics.ddp, "--stall-after 30"))[
        "stall_after"] == 30.0
    with pytest.raises(UsageError, match=r"--gpus takes a count \(2\) or GPU indices"):
        _values(RunOptions, parse_argstring(DDPMagics.ddp, "--gpus two"))


@pytest.mark.parametrize(("magic", "line", "refused"), [
    (DDPMagics.ddp, "--tim 00:20:00", "--tim"),  # was read as --timeout
    (DDPMagics.ddp, "--nproc 2", "--nproc"),
    (DDPMagics.ddp, "--nprocs 2 --max-r 1", "--max-r"),
    (DDPMagics.ddp_session, "start --nproc 2", "--nproc"),
])
def test_a_magic_takes_only_whole_flags(magic, line, refused):
    with pytest.raises(UsageError, match=f"unrecognized arguments: {refused}"):
        parse_argstring(magic, line)


def test_a_sessions_time_limit_is_not_taken_for_its_timeout():
    args = parse_argstring(DDPMagics.ddp_session, "start --slurm --time 00:20:00")
    assert args.time == "00:20:00" and args.timeout is None


@pytest.mark.parametrize("line, says", [
    ("start --nodes 2", "add --slurm or --ray to start the session's ranks on one"),
    ("start --time 00:10:00", "add --slurm to start the session's ranks as one"),
    ("stop --slurm", "are for %ddp_session start"),
    ("status --time 00:10:00", "are for %ddp_session start"),
    ("start --slurm --requeue", "does not take requeue"),
    ("start --grace 60", "add --slurm or --ray to start the session's ranks on one"),
    ("attach 12 --nprocs 2", "no options but the job id"),
    ("stop 12", "takes no job id"),
])
def test_a_session_takes_a_slurm_jobs_flags_only_to_start_one(line, says):
    with pytest.raises(UsageError, match=says):  # said before anything is submitted
        DDPMagics(shell=None).ddp_session(line)


# --- the options' checks -----------------------------------------------------------------


def test_the_options_are_checked_once_and_a_config_keeps_them():
    options = RunOptions(nprocs=2, env={"SEED": "1"}, max_restarts=1)
    assert options.env == {"SEED": "1"} and RunOptions().env == {}
    config = options.config(4, cuda_visible_devices="0,1")
    assert isinstance(config, RunConfig) and config.nprocs == 4 and config.max_restarts == 1
    assert config.env == {"SEED": "1"} and config.cuda_visible_devices == "0,1"
    with pytest.raises(ValueError, match="timeout must be a positive"):
        dataclasses.replace(config, timeout=-1)
    with pytest.raises(ValueError, match="stall_after must be a positive"):
        RunConfig(nprocs=1, stall_after=0)


def test_the_gpu_check_is_one_and_the_magic_says_it_in_flags(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU, whatever the machine has
    for gpus, typed in ((2, "2"), ([0, 1], "0,1")):
        with pytest.raises(GpusNotVisible, match=r"only 0 GPU\(s\) are visible.*nprocs=N") as e:
            RunOptions(gpus=gpus).on_this_machine()
        assert str(_usage_error(e.value, typed)) == (
            f"--gpus {typed} asks for more GPUs than the 0 visible; to run on the CPU, use "
            "%%ddp --nprocs N (gloo ranks) instead of --gpus")
    assert str(_usage_error(ValueError("timeout must be"), "2")) == "timeout must be"


def test_a_session_s_run_reuses_its_config_only_for_the_very_same_settings():
    """A session's quick cells do not check their settings again and again; a setting
    that compares equal but is not the same (``True`` for ``1``) is checked, and the
    session's ``env`` changed in place reaches the next run."""
    configs, session = ConfigPerRun(), RunConfig(nprocs=2, env={"SEED": "1"})
    first = configs.for_run(session, stall_after=1, ranks=None)
    assert first.stall_after == 1 and configs.for_run(session, stall_after=1,
                                                      ranks=None) is first
    with pytest.raises(ValueError, match="stall_after must be a positive"):
        configs.for_run(session, stall_after=True, ranks=None)
    assert configs.for_run(session, stall_after=1, ranks=(1,)).ranks == (1,)
    session.env["SEED"] = "2"
    assert configs.for_run(session, stall_after=1, ranks=(1,)).env == {"SEED": "2"}


def test_a_ddp_line_is_parsed_once_and_a_refused_one_is_refused_every_time():
    """A notebook reruns the same ``%%ddp`` lines: each is parsed once, and what the
    magic takes from it cannot change the next cell's options."""
    from nbddp._magic import _ddp_line

    args, options = _ddp_line("--nprocs 3 --gpus 0,1")
    assert _ddp_line("--nprocs 3 --gpus 0,1") == (args, options)
    assert options is not None and options["nprocs"] == 3 and options["gpus"] == [0, 1]
    with pytest.raises(TypeError):
        options["pdb"] = True  # type: ignore[index]  # (the magic copies them)
    for _ in range(2):
        with pytest.raises(UsageError, match="add --slurm"):
            _ddp_line("--nodes 2")
    assert _ddp_line("-h")[1] is None


@pytest.mark.parametrize("cell", [
    "x = 5\nx;", "x; # a comment", "x;\n# a comment after\n", "x = 5\nx",
    "s = 'a;b'\ns", "x  # ;", "for i in range(2): pass;\n", "print(1); print(2)"])
def test_a_cell_ending_in_a_semicolon_hides_its_value_as_ipython_decides(cell):
    """``%%ddp`` hides the value of a cell that ends in ';', as IPython decides for any
    cell, without tokenising cells that hold no ';'."""
    from IPython.core.displayhook import DisplayHook

    from nbddp._notebook.shell import unless_hidden

    hidden = DisplayHook.semicolon_at_end_of_expression(cell)
    assert unless_hidden("value", cell) == (None if hidden else "value")
