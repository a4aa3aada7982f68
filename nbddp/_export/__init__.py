"""A notebook function or cell as a readable script for torchrun (and sbatch).
"""
