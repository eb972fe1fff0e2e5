"""The default backend: every device's block in host memory, all devices in one numpy array."""

from __future__ import annotations

from typing import Any

import numpy as np

from .grid import GridBackend


class NumpyBackend(GridBackend):
    name = "numpy"

    def owns(self, a: Any) -> bool:
        return isinstance(a, np.ndarray)

    @property
    def xp(self) -> Any:
        return np

    def commit(self, x: Any, spec: Any) -> np.ndarray:
        if type(x) is not np.ndarray:
            x = np.asarray(x)
        if x.flags.writeable:
            x.setflags(False)  # (write=False) tensors are immutable: no block can be written through a view
        return x

    def to_host(self, x: Any) -> np.ndarray:
        return np.asarray(x)

    def fill(self, x: Any, regions: tuple, value: Any) -> np.ndarray:
        x = np.array(x)
        for idx in regions:
            x[idx] = value
        return x
