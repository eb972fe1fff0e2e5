"""The cost model behind every plan choice and every "est. us": per mesh axis, a latency (seconds per ring
step) and a bandwidth (bytes per second). A collective over several axes runs at the slowest of them."""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from typing import Iterator, Mapping, NamedTuple, Sequence

from .errors import ShardingError
from .scoped import setting


class AxisCost(NamedTuple):
    """The link a mesh axis runs over: seconds per ring step, and bytes per second."""

    latency: float = 5e-6
    bandwidth: float = 25e9


class CostModel:
    """Alpha-beta costs per mesh axis: ``CostModel(axes={"dp": AxisCost(20e-6, 12.5e9)})`` makes a slow
    inter-node ``dp`` next to the default fast links. Frozen and hashable: plans are cached per model."""

    __slots__ = ("default", "axes", "_links", "__weakref__")
    _interned: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()

    def __new__(cls, latency: float = 5e-6, bandwidth: float = 25e9,
                axes: Mapping[str, AxisCost | tuple[float, float]] | None = None) -> "CostModel":
        default = _axis_cost(latency, bandwidth, "default")
        if axes is not None and not isinstance(axes, Mapping):
            raise ShardingError(f"CostModel: axes must map axis names to (latency, bandwidth), got {axes!r}")
        per_axis = tuple(sorted((str(name), _axis_cost(*_pair(cost, name), name=name))
                                for name, cost in (axes or {}).items()))
        key = (default, per_axis)
        # equal models are one object, so hashing and comparing them (plan cache keys) is by identity
        self = cls._interned.get(key)
        if self is None:
            self = object.__new__(cls)
            object.__setattr__(self, "default", default)
            object.__setattr__(self, "axes", per_axis)
            object.__setattr__(self, "_links", {})  # axes -> ``link``'s answer (every collective asks it)
            cls._interned[key] = self
        return self

    def __setattr__(self, key, value):
        raise AttributeError("CostModel is immutable")

    def __reduce__(self):
        return (_rebuild, (self.default, self.axes))

    def __repr__(self) -> str:
        extra = ", axes={" + ", ".join(f"{n!r}: {c}" for n, c in self.axes) + "}" if self.axes else ""
        return f"CostModel(latency={self.default.latency}, bandwidth={self.default.bandwidth:g}{extra})"

    def link(self, axes: Sequence[str]) -> AxisCost:
        """The slowest link among ``axes`` (sub-axes ``x:(1)2`` run over axis ``x``'s link)."""
        key = tuple(axes)
        got = self._links.get(key)
        if got is None:
            table = dict(self.axes)
            links = [table.get(a.split(":")[0], self.default) for a in key] or [self.default]
            got = AxisCost(max(c.latency for c in links), min(c.bandwidth for c in links))
            if len(self._links) < 4096:
                self._links[key] = got
        return got

    def split(self, steps: int, nbytes: int, axes: Sequence[str]) -> tuple[int, int]:
        """(transfer, latency) of a collective in femtoseconds: whole numbers, so that equal plans tie exactly
        (the planner minimises the first, then the second, then the number of collectives)."""
        link = self.link(axes)
        return round(nbytes / link.bandwidth * 1e15), round(steps * link.latency * 1e15)

    def time(self, steps: int, nbytes: int, axes: Sequence[str]) -> float:
        """Estimated seconds: latency per ring step plus bytes over bandwidth."""
        link = self.link(axes)
        return steps * link.latency + nbytes / link.bandwidth


def _rebuild(default: AxisCost, axes: tuple) -> CostModel:
    return CostModel(default.latency, default.bandwidth, dict(axes))


def _pair(cost, name) -> tuple:
    try:
        latency, bandwidth = cost
    except (TypeError, ValueError):
        raise ShardingError(f"CostModel: axis {name!r} needs (latency, bandwidth), got {cost!r}") from None
    return latency, bandwidth


def _axis_cost(latency, bandwidth, name: str) -> AxisCost:
    for what, v in (("latency", latency), ("bandwidth", bandwidth)):
        if not isinstance(v, (int, float)) or isinstance(v, bool) or v != v or v < 0 or (what == "bandwidth" and v == 0):
            raise ShardingError(f"CostModel: {what} of {name!r} must be a number > 0 (latency may be 0), got {v!r}")
    return AxisCost(float(latency), float(bandwidth))


DEFAULT = CostModel()
_current: contextvars.ContextVar[CostModel] = contextvars.ContextVar("nabla_cost_model", default=DEFAULT)


@contextlib.contextmanager
def cost_model(model: CostModel) -> Iterator[CostModel]:
    """``with nb.cost_model(CostModel(...)):`` plan and estimate with these links."""
    if not isinstance(model, CostModel):
        raise ShardingError(f"cost_model: expected a CostModel, got {type(model).__name__}")
    with setting(_current, model, model):
        yield model


def current() -> CostModel:
    return _current.get()
