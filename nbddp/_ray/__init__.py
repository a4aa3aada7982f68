"""The Ray backend: a session's ranks as one placement group with an agent and torchrun
on every node; its options; attaching to it. Imports ray only when a run uses it.
"""
