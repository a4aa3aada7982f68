"""The notebook's own kernel, as nbddp meets it: IPython's input transformers (auto
mode), IPython's settings nbddp follows (``%autoreload``), and what the magics ask of
the shell (``shell``).

Imports nothing of nbddp's: the front door's magics and ``Session`` use it.
"""
