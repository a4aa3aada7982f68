"""What of a framework's logged values is worth a chart: numbers, not bookkeeping."""

from __future__ import annotations

from numbers import Real
from typing import Any

_BOOKKEEPING = ("epoch", "step", "total_flos")
_BOOKKEEPING_ENDS = ("_runtime", "_per_second")


def chartable(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` without text, counters and timing figures (``epoch``, ``total_flos``,
    ``*_runtime``, ``*_samples_per_second``...): the training's own numbers."""
    kept = {}
    for name, value in values.items():
        if name in _BOOKKEEPING or name.endswith(_BOOKKEEPING_ENDS):
            continue
        if isinstance(value, bool) or not _numeric(value):
            continue
        kept[name] = value
    return kept


def _numeric(value: Any) -> bool:
    if isinstance(value, Real):
        return True
    return getattr(value, "ndim", None) == 0  # a 0-d tensor or array
