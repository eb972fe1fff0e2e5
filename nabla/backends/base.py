"""The interface every backend implements (its own module, so the backends build on it and the package
imports them)."""

from __future__ import annotations

from typing import Any

import numpy as np


class Backend:
    """One place for arrays: its array namespace, how blocks reach their devices, and how to read them."""

    name = "?"

    def owns(self, a: Any) -> bool:
        """Whether array ``a`` lives on this backend."""
        raise NotImplementedError

    @property
    def xp(self) -> Any:
        """The numpy-like namespace kernels and moves call."""
        raise NotImplementedError

    def commit(self, x: Any, spec: Any) -> Any:
        """Stored blocks ``x`` (the grid of ``spec``'s own atoms in front) laid on the devices that own them;
        called after every placement, kernel and move. Also makes them immutable."""
        raise NotImplementedError

    def to_host(self, x: Any) -> np.ndarray:
        raise NotImplementedError

    def fill(self, x: Any, regions: tuple, value: Any) -> Any:
        """A copy of ``x`` with ``value`` written at each index tuple of ``regions``."""
        raise NotImplementedError

    def enter(self) -> Any:
        """Called when a ``with nb.backend(...)`` block starts; returns what ``leave`` needs to restore."""
        return None

    def leave(self, token: Any) -> None:
        return None
