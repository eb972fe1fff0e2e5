"""What a value is made of, and how readers outside the executor see it: ``Value`` holds stored blocks (or a host
array, or None when abstract), a spec, a shape and a dtype; the executor writes its underscore fields once, when
it makes the value, and everyone else reads them through read-only properties (a value is immutable)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from .spec import ShardingSpec
    from .trace import Node


class Value:
    """What a Tensor is made of: stored blocks (or a host array, or None if abstract), spec, shape, dtype;
    the layouts a partial value was already summed to (made once, reused by every later use); the id of
    its signature (kind, shape, dtype, spec), the program cache's key, computed once per value; and its serial
    in recorded steps (given on first need; values sharing their blocks share it)."""

    __slots__ = ("_data", "_spec", "_shape", "_dtype", "_moved", "_sid", "_node", "_serial", "__weakref__")

    def __init__(self, data: Any, spec: ShardingSpec | None, shape: tuple[int, ...], dtype: np.dtype,
                 sid: int = -1) -> None:
        self._data = data
        self._spec = spec
        self._shape = shape
        self._dtype = dtype
        self._moved: dict | None = None
        self._sid = sid
        self._node: Node | None = None  # how it was made, when it depends on a traced value
        self._serial = 0

    # ---- reading (no setters: assigning raises AttributeError) ----------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        """The global shape."""
        return self._shape

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    @property
    def sharding(self) -> ShardingSpec | None:
        """How the value is laid out over its mesh (partial axes included); None for a host or abstract value."""
        return self._spec

    @property
    def is_abstract(self) -> bool:
        """Whether the value holds no data (``nb.abstract``, or traced without values inside ``nb.jit``)."""
        return self._data is None

    @property
    def blocks(self) -> Any:
        """The stored data as the executor keeps it, read-only: a sharded value's blocks stacked on its layout's
        device grid (grid shape, then block shape), a host value's array, None when abstract. Not a copy."""
        d = self._data
        if type(d) is np.ndarray and d.flags.writeable:
            d = d.view()
            d.flags.writeable = False
        return d
