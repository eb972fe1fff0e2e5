"""``with nb.backend(name):`` selects where local kernels run. Only ``"numpy"`` exists so far."""

from __future__ import annotations

import contextlib
from typing import Iterator

from ..errors import ShardingError

_BACKENDS = ("numpy",)
_current = ["numpy"]


@contextlib.contextmanager
def backend(name: str) -> Iterator[None]:
    if name == "jax":
        raise ShardingError("backend: the jax backend (kernels on real jax devices) is not implemented yet; "
                            "use t.to_jax() to move a sharded tensor onto jax devices")
    if name not in _BACKENDS:
        raise ShardingError(f"backend: unknown backend {name!r}; available: {list(_BACKENDS)}")
    _current.append(name)
    try:
        yield
    finally:
        _current.pop()
