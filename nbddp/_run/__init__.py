"""The kernel-side core of a run: the job and how it ends, the pump over the ranks'
messages and the supervisor's handlers, attempts, results, the backend-neutral rank
group, its hooks and its launcher protocol, run options and shape, diagnosis, the
debugger's kernel half, records, and the per-rank view.

Imports ``_panel`` and ``_wire``; never a backend.
"""
