"""A device's timeline for a program of steps: a compute stream and a communication stream, with collectives
either blocking or (gradient reductions, under ``overlap="grads"``) running behind the backward compute."""

from __future__ import annotations

from typing import Iterable, NamedTuple, Sequence

from ..errors import ShardingError
from ..mesh import DeviceMesh
from .cluster import Cluster
from .comm import event_time
from .compute import kernel_times
from .steps import StepLike, is_grad_reduction

OVERLAPS = ("none", "grads")


class Interval(NamedTuple):
    """One busy span of a stream (``"compute"`` or ``"comm"``), in seconds from the start of the step."""

    stream: str
    start: float
    end: float
    step: int  # index of the step in program order
    name: str  # the kernel op, or the collective kind
    layer: str | None
    user: str


class StepCost(NamedTuple):
    """What one step cost: its kernel, its collectives, and how far it held back the compute stream beyond
    its kernel (``exposed``; the comm stream's tail after the last kernel is charged to the step it ran for)."""

    index: int
    layer: str | None
    user: str
    phase: str
    kernel: float
    comm: float
    exposed: float
    flops: int
    kernel_of: int = -1  # the first step of the kernel this step's work ran in (itself unless fused)


class Timeline(NamedTuple):
    """The schedule of one device. ``exposed_comm = step_time - compute_time``: time the compute stream waits."""

    intervals: tuple[Interval, ...]
    costs: tuple[StepCost, ...]
    step_time: float
    compute_time: float
    comm_time: float

    @property
    def exposed_comm(self) -> float:
        return self.step_time - self.compute_time


def simulate(steps: Iterable[StepLike], cluster: Cluster, mesh: DeviceMesh, overlap: str = "none",
             drop_grad_comm: bool = False, fusion: bool = True,
             kernels: tuple[Sequence[float], Sequence[int]] | None = None, durations: dict | None = None) -> Timeline:
    """Lay ``steps`` (program order) out on two streams. A step's collectives run before its kernel. Under
    ``overlap="none"`` each collective waits for the compute before it and the compute after it waits for
    the collective. Under ``"grads"`` the collectives of gradient reductions (backward steps whose ``user``
    starts with ``"grad of"``) start when their data is ready and the comm stream is free, and nothing
    waits for them until the end of the step; every other collective still blocks (and so waits for the
    comm stream too). ``drop_grad_comm`` leaves gradient reductions' collectives out (to measure them).
    ``fusion``: chains of elementwise steps priced as one kernel (``compute.kernel_times``); ``kernels``: the
    ``kernel_times`` of ``steps`` already computed (it then wins over ``fusion``); ``durations``: collectives'
    times by ``(kind, axes, bytes, group)``, filled and reused (a program repeats its collectives)."""
    if overlap not in OVERLAPS:
        raise ShardingError(f"estimate: overlap must be one of {list(OVERLAPS)}, got {overlap!r}")
    steps = steps if isinstance(steps, (list, tuple)) else list(steps)
    kernels = kernel_times(steps, cluster.hardware, fusion) if kernels is None else kernels
    return _lay_out(steps, kernels, cluster, mesh, overlap, drop_grad_comm, {} if durations is None else durations,
                    True)


def step_end(steps: Sequence[StepLike], kernels: tuple[Sequence[float], Sequence[int]], cluster: Cluster,
             mesh: DeviceMesh, overlap: str, drop_grad_comm: bool, durations: dict) -> float:
    """``simulate(...).step_time`` without the timeline's records (what ``exposed_grad_comm`` needs twice);
    ``durations`` caches collectives' times between calls."""
    return _lay_out(steps, kernels, cluster, mesh, overlap, drop_grad_comm, durations, False)


def _lay_out(steps: Sequence[StepLike], kernels: tuple[Sequence[float], Sequence[int]], cluster: Cluster,
             mesh: DeviceMesh, overlap: str, drop_grad_comm: bool, durations: dict, record: bool):
    times, first = kernels
    comp = comm = 0.0  # when each stream is next free
    intervals: list[Interval] = []
    costs: list[StepCost] = []
    last_comm_owner = -1
    for i, s in enumerate(steps):
        before = comp
        grad = is_grad_reduction(s)
        hidden = overlap == "grads" and grad
        comm_total = 0.0
        for e in (() if drop_grad_comm and grad else s.events):
            key = (e.kind, e.axes, e.bytes, e.group)
            dur = durations.get(key)
            if dur is None:
                dur = durations[key] = event_time(e, cluster, mesh)
            start = max(comp, comm)
            if record:
                intervals.append(Interval("comm", start, start + dur, i, e.kind, s.layer, s.user))
            comm = start + dur
            if not hidden:
                comp = comm
            comm_total += dur
            last_comm_owner = i
        k = times[i]
        if record:
            if k:
                intervals.append(Interval("compute", comp, comp + k, i, s.op, s.layer, s.user))
            costs.append(StepCost(i, s.layer, s.user, s.phase, k, comm_total, comp - before, int(s.flops),
                                  first[i]))
        comp += k
    end = max(comp, comm)
    if not record:
        return end
    if end > comp and last_comm_owner >= 0:  # the comm stream's tail: charged to the step it ran for
        c = costs[last_comm_owner]
        costs[last_comm_owner] = c._replace(exposed=c.exposed + end - comp)
    compute_time = sum(c.kernel for c in costs)
    return Timeline(tuple(intervals), tuple(costs), end, compute_time, sum(c.comm for c in costs))
