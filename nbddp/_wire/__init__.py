"""What crosses the boundary between the kernel and the ranks: the messages, the
authenticated channel and the mailbox files that carry them, the payload, the data plane
for tensors, the run directory, stack dumps and metric history.

Both sides import these modules; they import nothing else of nbddp (but ``_errors``).
"""
