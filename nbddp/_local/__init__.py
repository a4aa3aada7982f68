"""The local backend: a rank group started by torchrun on this machine, and standby
groups kept warm for the next launch.
"""
