"""The sbatch text that starts a run on a SLURM cluster: one task per node, each a
torchrun joined by c10d rendezvous on the job's own port.

``sbatch_text`` is the file ``export`` writes beside a script; ``submission_sbatch_text``
is the batch script of a run submitted from the notebook, ``session_sbatch_text`` that
of a session's ranks. All are pure functions of their arguments, the first two pinned by
golden-file tests.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence

from .._run.config import relay_option, torchrun_environment
from .._wire.rundir import (
    ADDRESS,
    KEY,
    LAUNCHER_LOG,
    NODE_FOLDER,
    PAYLOAD,
    REQUEUE_FILE_ENV,
    STOP_FILE_ENV,
)
from .files import NODE_EPILOG, REQUEUE_FILE, STOP_FILE
from .options import SlurmOptions, rendezvous_port


def _directives(job_name: str, options: SlurmOptions, output: str, error: str | None,
                more: Sequence[str] = ()) -> list[str]:
    lines = ["#!/bin/bash", f"#SBATCH --job-name={job_name}", f"#SBATCH --nodes={options.nodes}",
             "#SBATCH --ntasks-per-node=1"]
    if options.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={options.gpus_per_node}")
    if options.cpus_per_task:
        lines.append(f"#SBATCH --cpus-per-task={options.cpus_per_task}")
    if options.time:
        lines.append(f"#SBATCH --time={options.time}")
    if options.partition:
        lines.append(f"#SBATCH --partition={options.partition}")
    lines.append(f"#SBATCH --output={output}")
    if error:
        lines.append(f"#SBATCH --error={error}")
    return lines + [f"#SBATCH {line}" for line in (*more, *options.extra)]


def sbatch_text(script: str, job_name: str, options: SlurmOptions) -> str:
    """An sbatch file: one task per node, each a torchrun joined by c10d rendezvous."""
    lines = _directives(job_name, options, f"{job_name}-%j.out", f"{job_name}-%j.err")
    lines += [
        "",
        "# The first node of the allocation hosts the rendezvous, on the job's own port.",
        'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f"port={rendezvous_port(options.port)}",
        *_restart_exports(options.max_restarts),
        "",
        f"srun torchrun --nnodes \"$SLURM_NNODES\" --nproc_per_node {options.nprocs_per_node} \\",
        *([f"    --max-restarts {options.max_restarts} \\"] if options.max_restarts else []),
        "    --rdzv-backend c10d --rdzv-id \"$SLURM_JOB_ID\" \\",
        f"    --rdzv-endpoint \"$head:$port\" {script}",
    ]
    return "\n".join(lines) + "\n"


def submission_sbatch_text(run_dir: str, python: str, options: SlurmOptions) -> str:
    """The sbatch file of a run submitted from the notebook: on each node, nbddp's
    torchrun wrapper starts nbddp's worker, which reports to the kernel or the mailbox.
    The script waits for its job step in the background, so that SLURM's warning signal
    reaches it at once, and requeues the job when the ranks asked for it."""
    folder, python = shlex.quote(run_dir), shlex.quote(python)
    ends = ["--open-mode=append",  # a requeued run's output follows the first one's
            *(["--requeue"] if options.requeue else []),
            *([f"--signal=B:USR1@{options.signal_before}"] if options.signal_before else [])]
    lines = _directives("nbddp", options, f"{run_dir}/{LAUNCHER_LOG}", None, ends)  # no shell
    lines += [
        "",
        "# Submitted by nbddp from a notebook: the ranks load the payload in this run",
        "# folder and report to the kernel, or to files here when they cannot reach it.",
        'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f"port={rendezvous_port(options.port)}",
        *_restart_exports(options.max_restarts),
        "# Each run of the job (a requeue runs it again) starts with no stop and no requeue.",
        f"export {STOP_FILE_ENV}={folder}/{STOP_FILE} {REQUEUE_FILE_ENV}={folder}/{REQUEUE_FILE}",
        f': >"${STOP_FILE_ENV}"; rm -f "${REQUEUE_FILE_ENV}"',
        *([f"trap 'echo \"SLURM: the time limit is near\" >>\"${STOP_FILE_ENV}\"' USR1"]
          if options.signal_before else []),
        "",
        f"srun --kill-on-bad-exit=1 {python} -m nbddp._torchrun {folder} - \\",
        f"    --nnodes \"$SLURM_NNODES\" --nproc-per-node {options.nprocs_per_node} "
        f"--max-restarts {options.max_restarts} \\",
        "    --rdzv-backend c10d --rdzv-id \"$SLURM_JOB_ID\" --rdzv-endpoint \"$head:$port\" \\",
        f"    -m nbddp._worker {folder} --mailbox &",
        "step=$!",
        'wait "$step"; status=$?',
        'while kill -0 "$step" 2>/dev/null; do wait "$step"; status=$?; done  # a signal woke it',
        f'if [ "$status" = 0 ] && [ -e "${REQUEUE_FILE_ENV}" ]; then',
        '    echo "nbddp: the ranks called nbddp.requeue(): requeueing SLURM job $SLURM_JOB_ID"',
        '    scontrol requeue "$SLURM_JOB_ID" || status=$?',
        "fi",
        'exit "$status"',
    ]
    return "\n".join(lines) + "\n"


def session_torchrun(run_dir: str, python: str, nodes: int, nprocs_per_node: int) -> list[str]:
    """The command each node of a session runs (one task per node, in a batch job or a
    job step of the kernel's allocation), up to its rendezvous options: nbddp's torchrun
    wrapper, with no lifeline (the job outlives a kernel), and folders on the node for
    the data files the kernel sends; a relay where a node has several ranks."""
    return [python, "-m", "nbddp._torchrun", run_dir, "-", *relay_option(nprocs_per_node, nodes),
            "--node-data", "--nnodes", str(nodes),
            "--nproc-per-node", str(nprocs_per_node), "--max-restarts", "0",
            "--rdzv-backend", "c10d"]


def node_epilog_text() -> str:
    """The task epilog of a session's ranks (``srun --task-epilog``): SLURM runs it on
    every node once the node's torchrun has ended, however it ended, and it removes that
    node's data folders (nbddp's torchrun removes them too, when it can)."""
    name = NODE_FOLDER.format(uid="$(id -u)", job="${SLURM_JOB_ID}", step="${SLURM_STEP_ID}",
                              node="${SLURMD_NODENAME}")
    return ("#!/bin/sh\n"
            "# nbddp: this node's data folders of a session, once its torchrun has ended\n"
            f'name="{name}"\n'
            'rm -rf -- "${NBDDP_SHM_DIR:-/dev/shm}/$name" "${TMPDIR:-/tmp}/$name"\n')


def session_worker(run_dir: str, prepare: str | None, grace: float | None) -> list[str]:
    """The rest of that command: the ranks connect to the kernel's TCP channel and wait
    there for each run, and for a kernel to attach for ``grace`` seconds after theirs went
    (None: as long as the job runs)."""
    return ["-m", "nbddp._worker", run_dir, "--remote",
            *(["--prepare", prepare] if prepare else []),
            *(["--grace", f"{grace:g}"] if grace is not None else [])]


def session_sbatch_text(run_dir: str, python: str, options: SlurmOptions,
                        prepare: str | None, grace: float | None) -> str:
    """The sbatch file of a session's ranks (``session_torchrun`` and ``session_worker``
    on every node). However the job ends, its secrets go with it."""
    folder = shlex.quote(run_dir)
    lines = _directives("nbddp-session", options, f"{run_dir}/{LAUNCHER_LOG}", None,
                        ["--open-mode=append",  # a requeue would lose the state: the
                         "--no-requeue"])  # session starts fresh ranks itself, and says so
    secrets = " ".join(f"{folder}/{name}" for name in (KEY, ADDRESS, PAYLOAD))
    rendezvous = '--rdzv-id "$SLURM_JOB_ID" --rdzv-endpoint "$head:$port"'
    lines += [
        "",
        "# Started by nbddp for a notebook's session: the ranks reach the kernel over the",
        "# TCP channel named in this run folder, and run one cell after another.",
        'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f"port={rendezvous_port(options.port)}",
        f"trap {shlex.quote(f'rm -f {secrets}')} EXIT",
        "trap 'exit 143' TERM  # scancel, the time limit: the secrets go too",
        "",
        f"srun --kill-on-bad-exit=1 --task-epilog={folder}/{NODE_EPILOG} \\",
        "    " + _words(session_torchrun(
            run_dir, python, options.nodes, options.nprocs_per_node)) + " \\",
        f"    {rendezvous} \\",
        f"    {_words(session_worker(run_dir, prepare, grace))} &",
        'wait "$!"',
    ]
    return "\n".join(lines) + "\n"


def _words(words: list[str]) -> str:
    return " ".join(shlex.quote(word) for word in words)


def _restart_exports(max_restarts: int) -> list[str]:
    """Shell lines for torchrun's environment when it may restart the ranks."""
    return [f"export {name}={value}  # restarted ranks get a store of their own"
            for name, value in torchrun_environment(max_restarts).items()]
