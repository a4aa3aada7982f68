"""Export a notebook function as a standalone script and an sbatch file.

``script_text`` (and the SLURM backend's ``sbatch_text``) are pure functions of their
arguments (pinned by golden-file tests); ``export`` gathers their inputs and writes the
files. The script
runs under ``torchrun``, under ``srun`` (one task per rank) and as plain ``python``
(a world of one), with no notebook, no IPython and no nbddp needed to start it.
"""

from __future__ import annotations

import os
import types
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import cloudpickle

from .._rank.cell import Cell
from .._slurm.options import PORT_BASE, PORT_SPAN, SlurmOptions
from .._slurm.sbatch import sbatch_text
from .source import Standalone, is_literal, standalone, standalone_names

_SETUP = '''

def _distributed_env() -> bool:
    """torchrun sets RANK & co.; under srun (one task per rank) derive them from SLURM."""
    if "RANK" in os.environ:
        return True
    if "SLURM_PROCID" not in os.environ:
        return False
    import subprocess

    first = subprocess.run(["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]],
                           capture_output=True, text=True, check=True).stdout.split()[0]
    os.environ.update(RANK=os.environ["SLURM_PROCID"], WORLD_SIZE=os.environ["SLURM_NTASKS"],
                      LOCAL_RANK=os.environ["SLURM_LOCALID"], MASTER_ADDR=first)
    os.environ.setdefault("MASTER_PORT", str({base} + int(os.environ["SLURM_JOB_ID"]) % {span}))
    return True


def _start_process_group():
    """The default process group as nbddp sets it up: NCCL on a GPU rank, else gloo."""
    import torch
    import torch.distributed

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    on_gpu = torch.cuda.is_available() and local_rank < torch.cuda.device_count()
    if on_gpu:
        torch.cuda.set_device(local_rank)
    backend = "nccl" if on_gpu else "gloo"
    if _distributed_env():
        torch.distributed.init_process_group(backend)
    else:  # plain `python {script}`: one rank, no rendezvous
        store = torch.distributed.HashStore()
        torch.distributed.init_process_group(backend, store=store, rank=0, world_size=1)
    return torch.distributed


def _leave() -> None:
    """End the process once the run is over, as Python would (its other threads waited
    for, its exit handlers run: nbddp's last metrics), but without C++ static destructors:
    torch's gloo can abort in them after a clean run ("terminate called without an active
    exception"), and torchrun and SLURM would report the job as failed."""
    import atexit
    import sys
    import threading

    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
'''

_FUNCTION_MAIN = '''

def main() -> None:
    """Call {name} on every rank; print rank 0's result."""
    dist = _start_process_group()
    result = {call}
    if dist.get_rank() == 0:
        print(f"{name} returned: {{result!r}}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    _leave()
'''

_CELL_MAIN = '''

_process_group = _start_process_group()

# --- the notebook cell ---------------------------------------------------------------
{source}
# --- end of the cell -----------------------------------------------------------------

_process_group.destroy_process_group()
_leave()
'''


def script_text(subject: str, script: str, needs: Standalone, main: str,
                payload_file: str | None) -> str:
    """A readable script: the notebook's imports, its definitions, then ``main`` (from
    ``function_main`` or ``cell_main``), after the process-group setup."""
    header = (f'#!/usr/bin/env python\n"""{script}: {subject} exported from a notebook '
              'by nbddp.\n\n'
              f"Run it on one machine:   torchrun --nproc_per_node 2 {script}\n"
              f"as a single process:     python {script}\n"
              f"on a SLURM cluster:      sbatch {Path(script).stem}.sbatch\n"
              '"""\n\n')
    imports = ["import os", *(["import cloudpickle"] if payload_file else []), *needs.imports]
    parts = [header + "\n".join(imports) + "\n"]
    if payload_file:
        loads = "\n".join(f"{key} = _data[{key!r}]" for key in needs.data)
        parts.append(
            "# Objects that have no source in the notebook, saved beside this script.\n"
            "_here = os.path.dirname(os.path.abspath(__file__))\n"
            f"with open(os.path.join(_here, {payload_file!r}), \"rb\") as _file:\n"
            f"    _data = cloudpickle.load(_file)\n{loads}\n")
    parts.extend(needs.definitions)
    text = "\n\n".join(p.rstrip("\n") + "\n" for p in parts)
    return text + _SETUP.format(script=script, base=PORT_BASE, span=PORT_SPAN) + main


def function_main(name: str, call: str) -> str:
    """The end of a function's script: ``main()`` calls it on every rank."""
    return _FUNCTION_MAIN.format(name=name, call=call)


def cell_main(source: str) -> str:
    """The end of a cell's script: the cell's own lines, between setup and teardown."""
    return _CELL_MAIN.format(source=source.strip("\n"))


def _call(name: str, args: tuple, kwargs: dict[str, Any], data: dict[str, Any]) -> str:
    """The call expression; arguments that are not literals go into the payload."""
    parts = []
    for i, value in enumerate(args):
        parts.append(repr(value) if is_literal(value) else _stash(data, f"_arg{i}", value))
    for key, value in kwargs.items():
        parts.append(f"{key}=" + (repr(value) if is_literal(value)
                                  else _stash(data, f"_kwarg_{key}", value)))
    return f"{name}({', '.join(parts)})"


def _stash(data: dict[str, Any], key: str, value: Any) -> str:
    data[key] = value
    return key


def export(
    fn: Any,
    path: str | os.PathLike,
    *,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    nodes: int = 1,
    nprocs: int | None = None,
    gpus: int = 0,
    time: str | None = None,
    partition: str | None = None,
    cpus_per_task: int | None = None,
    sbatch: Sequence[str] = (),
    max_restarts: int = 0,
) -> list[Path]:
    """Write ``path`` (a script that runs ``fn(*args, **kwargs)`` on every rank), a
    ``.sbatch`` file beside it, and a ``.payload.pkl`` for objects without source.

    ``fn`` is a function defined in the notebook (``%%ddp --export`` passes a cell).
    ``nprocs`` is ranks per node (default: ``gpus``, or 1 on CPU nodes);
    ``cpus_per_task`` is the CPUs of each node's torchrun and its ranks; ``sbatch`` adds
    ``#SBATCH`` lines; ``max_restarts`` is torchrun's ``--max-restarts`` in the sbatch
    file. Returns the paths written.
    """
    # The defaults are Slurm's, RunOptions' and SlurmOptions' (tests/test_options.py pins
    # them); SlurmOptions checks the values.
    if not isinstance(fn, (types.FunctionType, Cell)):
        raise TypeError(f"export takes a function defined in the notebook, got {fn!r}")
    options = SlurmOptions(nodes=nodes, nprocs_per_node=gpus or 1 if nprocs is None else nprocs,
                           gpus_per_node=gpus, cpus_per_task=cpus_per_task, time=time,
                           partition=partition, extra=tuple(sbatch), max_restarts=max_restarts)
    script = Path(path)
    if isinstance(fn, Cell):
        needs = standalone_names(fn.namespace)
        subject, main = "a cell", cell_main(fn.source)
    else:
        needs = standalone(fn)
        call = _call(fn.__name__, tuple(args), dict(kwargs or {}), needs.data)
        subject, main = f"`{fn.__name__}`", function_main(fn.__name__, call)
    payload = script.with_suffix(".payload.pkl")
    text = script_text(subject, script.name, needs, main, payload.name if needs.data else None)
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(text)
    written = [script, script.with_suffix(".sbatch")]
    written[1].write_text(sbatch_text(script.name, script.stem, options))
    if needs.data:
        payload.write_bytes(cloudpickle.dumps(needs.data))
        written.append(payload)
    return written
