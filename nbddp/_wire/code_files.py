"""Code shipped by value keeps the name of the file (or notebook cell) it was written in.

cloudpickle 3.1.3 and later pickle every code object as if written in
``<dynamic-code>`` (a payload that does not depend on where it was defined). A rank's
traceback then cannot show the user's lines, though the payload carries the cells'
sources for exactly that, and stacks cannot say which cell a rank is in. The pickler
(``tensor_pickler``) reduces code objects with ``reduce_code``: cloudpickle's reduction,
rebuilt on the rank under its real file name.
"""

from __future__ import annotations

import types
from typing import Any

import cloudpickle

_cloudpickles = cloudpickle.Pickler.dispatch_table[types.CodeType]


def reduce_code(code: types.CodeType) -> tuple[Any, tuple[Any, ...]]:
    """cloudpickle's reduction of ``code``, which ``code_in_file`` rebuilds in its file."""
    build, args = _cloudpickles(code)
    return code_in_file, (build, args, code.co_filename)


def code_in_file(build: Any, args: tuple[Any, ...], filename: str) -> types.CodeType:
    """(On the rank) The code object, under the file name it had in the kernel."""
    code: types.CodeType = build(*args)
    return code if code.co_filename == filename else code.replace(co_filename=filename)
