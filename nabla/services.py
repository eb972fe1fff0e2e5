"""What the layers above tensors provide to Tensor's methods: the ops (``t + u``, ``t.sum()``), numpy's protocols
and autodiff (``t.trace()``, ``loss.backward()``), by name. Those layers build on tensors and register here when
they are imported, so ``tensor.py`` calls them without importing them (no import cycle)."""

from __future__ import annotations

from typing import Any

from .errors import ShardingError

_PROVIDED: dict[str, Any] = {}


def provide(name: str, what: Any) -> None:
    """Register ``what`` (a module or a function) under ``name``."""
    _PROVIDED[name] = what


def get(name: str) -> Any:
    what = _PROVIDED.get(name)
    if what is None:
        raise ShardingError(f"internal: nabla's {name!r} layer is not imported (import nabla, not nabla.tensor alone)")
    return what
