"""Everything a rank runs: the entry points torchrun starts, the rank loop, its link to
the kernel, pdb over that link, stats, ``log``/``progress``, a cell's scope, models made
whole, requeues and restarts.

A rank imports only these modules and ``_wire``: never the kernel's machinery.
"""
