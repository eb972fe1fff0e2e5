"""What a value is made of, and how readers outside the executor see it: ``Value`` holds stored blocks (or a host
array, or None when abstract), a spec, a shape, a dtype and its serial, all given when it is made (a twin: the same
blocks under another serial or record); everyone reads them through read-only properties (a value is immutable).
How it was made is not on it: autodiff's tape links a value to the step that made it (``trace.link``). Only what is
filled in on first need is written later, here: the serial, the signature id and the sums made of a partial
value."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

if TYPE_CHECKING:
    from .spec import ShardingSpec


_SERIALS = itertools.count(1)  # atomic under the GIL: two threads never get the same serial


def serial(v: Any) -> int:
    """The serial number naming value ``v`` in recorded steps (0 for a Python scalar), given on first need.
    Values that share their blocks (a summed copy, a traced twin) share it: they are the same value."""
    s = getattr(v, "_serial", None)
    if s is None:
        return 0
    if s == 0:
        s = v._serial = next(_SERIALS)
    return s


class Value:
    """What a Tensor is made of: stored blocks (or a host array, or None if abstract), spec, shape, dtype;
    the layouts a partial value was already summed to (made once, reused by every later use); the id of
    its signature (kind, shape, dtype, spec), the program cache's key, computed once per value; and its serial
    in recorded steps (given on first need; values sharing their blocks share it)."""

    __slots__ = ("_data", "_spec", "_shape", "_dtype", "_moved", "_sid", "_serial", "__weakref__")

    def __init__(self, data: Any, spec: ShardingSpec | None, shape: tuple[int, ...], dtype: np.dtype,
                 sid: int = -1, serial: int | None = 0, moved: dict | None = None) -> None:
        """A twin of a value (the same blocks under another record) passes that value's ``serial`` (``None``: it
        names no recorded value) and ``moved``."""
        self._data = data
        self._spec = spec
        self._shape = shape
        self._dtype = dtype
        self._moved = moved
        self._sid = sid
        self._serial = serial

    def twin(self, sums: bool = False) -> "Value":
        """The same value (its blocks, signature id and serial; with ``sums``, the sums made of it too) as another
        object: the tape links objects, so a twin carries another record, or none, of what is one value."""
        return type(self)(self._data, self._spec, self._shape, self._dtype, self._sid, serial(self),
                          self._moved if sums else None)

    # ---- what is filled in on first need (a cache of the value's own facts, not a change of it) ----------------
    def signature_id(self, intern: Callable[[], int], stale: bool = False) -> int:
        """The id of this value's signature: ``intern()`` on first need (again when the table that gave it was
        emptied: ``stale``), then kept, so the executor's program lookup reads one int per operand."""
        i = self._sid
        if i < 0 or stale:
            i = self._sid = intern()
        return i

    def drop_copies(self) -> None:
        """Forget the gathered copies kept on this value (its program ended: later uses gather anew)."""
        if self._moved is not None and not (self._spec is not None and self._spec.partial_axes):
            self._moved = None

    def keep_sum(self, layout: Any, data: Any) -> None:
        """Remember this partial value summed into ``layout`` (its stored ``data``), or a traced value's gathered
        copy (``trace.gathered_copy``): a later use in that layout reuses it (it is the same value; the sum or the
        gather is paid once)."""
        if self._moved is None:
            self._moved = {}
        self._moved[layout] = data

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
