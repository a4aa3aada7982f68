"""The notebook's own kernel, as nbddp meets it: IPython's input transformers (auto
mode) and IPython's settings nbddp follows (``%autoreload``).

Imports nothing of nbddp's: the front door's magics and ``Session`` use it.
"""
