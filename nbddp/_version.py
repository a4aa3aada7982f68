"""nbddp's version, on the bottom floor: the kernel and the ranks both check it."""

__version__ = "0.2.0"
