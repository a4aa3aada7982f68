"""The SLURM backend: a rank group that is a SLURM job, its options, and the sbatch
text that starts torchrun on each node.
"""
