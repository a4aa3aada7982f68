"""What went wrong, and where the ranks are: the root cause of a failed run, a stalled
run's stacks and hang report, process-group set-up that hangs, each rank's live view and
step time, and pdb on the ranks. The run (``_run``) asks; these rooms answer.
"""
