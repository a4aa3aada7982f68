"""A session's side of the kernel: the ranks over the session's life, a run on them
(whether they stay), the names they hold, which ranks a run is given to, the ranks on
other machines, and what ``%ddp_session`` says.
"""
