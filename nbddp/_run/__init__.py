"""The kernel-side core of a run: the job, the supervisor that pumps the ranks' messages,
the backend-neutral rank group and its launcher protocol, run options and shape,
diagnosis, the debugger's kernel half, records, and the per-rank view.

Imports ``_panel`` and ``_wire``; never a backend.
"""
