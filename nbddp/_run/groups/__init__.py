"""Rank groups: the ranks of a run, their run dir, channel and launcher; ranks that wait
for their run (roll calls, held results, where a payload travels), and the shape a
group's ranks see.
"""
