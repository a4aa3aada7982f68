"""The kernel-side core of a run: the job and how it ends (``job``, ``run_end``,
``run_course``, ``supervisor`` and its parts, ``pump``, ``attempts``, ``results``),
run options and the backend interface (``config``, ``flags``, ``backend``,
``cluster_kind``), and records. Three rooms inside: ``groups`` (the ranks of a run and
those that wait for theirs), ``session`` (a session's side), ``diagnosis`` (what went
wrong, and where the ranks are).

Imports ``_panel`` and ``_wire``; never a backend.
"""
