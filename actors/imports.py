"""User code named in a config as ``module:function``: imported once, checked, one-line errors."""

from __future__ import annotations

import importlib
from typing import Any, Callable


def import_callable(spec: str, what: str) -> Callable[..., Any]:
    """The callable ``spec`` (``module:function``) names; ValueError naming ``what`` and the fault."""
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"{what} {spec!r} must be 'module:function'")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{what} {spec!r}: {e}") from None
    if not callable(fn):
        raise ValueError(f"{what} {spec!r} is not callable")
    return fn
