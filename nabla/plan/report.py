"""The estimate of one training step from its recorded steps: times, FLOP rates, MFU and memory, printed per
layer, exported as a Chrome trace and plotted. The schedule behind it is schedule.py's."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Iterable, Mapping, Sequence

from ..collectives import abbreviate
from ..errors import ShardingError
from ..mesh import DeviceMesh
from .cluster import Cluster
from .hardware import dtype_key
from .compute import kernel_times
from .schedule import Timeline, overlap_modes, simulate, step_end
from .steps import MATMUL_OPS, StepLike


@dataclass(frozen=True)
class MemoryReport:
    """Per device id: ``peak`` (most bytes live at once) and ``by_kind[kind][d]``, as ``nb.memory_log`` records
    them; ``capacity`` is the device's HBM. ``fits`` is ``None`` when no memory record was given."""

    peak: Mapping[int, int]
    by_kind: Mapping[str, Mapping[int, int]]
    capacity: int
    live: tuple[int, ...] = ()  # bytes live after each step, one device's (for plots), when recorded
    recorded: bool = False
    kept: Mapping[int, int] = field(default_factory=dict)  # kept for the backward pass as it starts (a microbatch's)

    @property
    def fits(self) -> bool | None:
        if not self.recorded:
            return None
        return all(v <= self.capacity for v in self.peak.values())

    def __str__(self) -> str:
        """The most bytes any device holds, per kind, against the capacity (as ``nb.memory_log``'s summary)."""
        gib = 2 ** 30
        if not self.recorded:
            return f"memory: not recorded (capacity {self.capacity / gib:.2f} GiB per device)"
        top = max(self.peak.values(), default=0)
        kinds = ", ".join(f"{k} {max(v.values(), default=0) / gib:.2f}" for k, v in self.by_kind.items())
        return (f"memory: peak {top / gib:.2f} GiB of {self.capacity / gib:.2f} GiB per device "
                f"({'fits' if self.fits else 'DOES NOT FIT'}); by kind (GiB): {kinds}")

    @classmethod
    def of(cls, record: Any, capacity: int) -> "MemoryReport":
        """From a memory record (anything with ``.peak`` and ``.by_kind`` mappings, and optionally ``.timeline``,
        one device's live bytes after each step, as ``nb.memory_log`` keeps it), or an empty report for ``None``."""
        if record is None:
            return cls(MappingProxyType({}), MappingProxyType({}), capacity)
        try:
            peak = dict(record.peak)
            by_kind = {str(k): MappingProxyType(dict(v)) for k, v in dict(getattr(record, "by_kind", {})).items()}
        except (AttributeError, TypeError, ValueError):
            raise ShardingError(f"estimate: memory must have .peak (device -> bytes) and .by_kind (kind -> device "
                                f"-> bytes), got {type(record).__name__}") from None
        live = tuple(int(b) for b in getattr(record, "timeline", ()) or ())
        kept = {int(d): int(b) for d, b in dict(getattr(record, "kept", {}) or {}).items()}
        return cls(MappingProxyType(peak), MappingProxyType(by_kind), capacity, live, True, MappingProxyType(kept))


@dataclass(frozen=True)
class Report:
    """One step's estimate on one device (every device runs the same SPMD program; ``devices`` lists them).

    ``step_time``, ``compute_time`` (sum of kernels), ``comm_time`` (sum of collectives), ``exposed_comm``
    (``step_time - compute_time``) and ``exposed_grad_comm`` (what the gradient reductions add to the step)
    are seconds. ``flops`` and ``model_flops`` are per device; ``tflops_per_device`` counts every executed
    FLOP (recomputation included, as Megatron-LM's Table 1 does), ``mfu`` only ``model_flops`` over the peak
    of ``peak_dtype``."""

    timeline: Timeline
    cluster: Cluster
    mesh: DeviceMesh
    overlap: Any  # as given: "none", "grads", "all" or a tuple of modes (``overlaps`` has them as a set)
    flops: int
    model_flops: float
    peak_dtype: str
    exposed_grad_comm: float
    memory: MemoryReport
    fusion: bool = True

    @property
    def step_time(self) -> float:
        return self.timeline.step_time

    @property
    def overlaps(self) -> frozenset[str]:
        """The overlap modes the schedule ran with (``schedule.overlap_modes``)."""
        return overlap_modes(self.overlap)

    @property
    def compute_time(self) -> float:
        return self.timeline.compute_time

    @property
    def comm_time(self) -> float:
        return self.timeline.comm_time

    @property
    def exposed_comm(self) -> float:
        return self.timeline.exposed_comm

    @property
    def devices(self) -> tuple[int, ...]:
        return self.mesh.devices

    @property
    def peak_flops(self) -> float:
        return self.cluster.hardware.peak(self.peak_dtype)

    @property
    def tflops_per_device(self) -> float:
        return self.flops / self.step_time / 1e12 if self.step_time else 0.0

    @property
    def mfu(self) -> float:
        return self.model_flops / self.step_time / self.peak_flops if self.step_time else 0.0

    def device_timeline(self, device: int) -> Timeline:
        """The timeline of ``device`` (one SPMD program: every device's is the same)."""
        self.mesh.coords(device)  # validates
        return self.timeline

    def layers(self) -> list[tuple[str, float, float, float, int]]:
        """Rows ``(layer, compute s, comm s, exposed s, flops)`` in order of first appearance."""
        rows: dict[str, list] = {}
        for c in self.timeline.costs:
            r = rows.setdefault("-" if c.layer is None else str(c.layer), [0.0, 0.0, 0.0, 0])
            r[0] += c.kernel
            r[1] += c.comm
            r[2] += c.exposed
            r[3] += c.flops
        return [(name, *vals) for name, vals in rows.items()]

    def __str__(self) -> str:
        hw, cl = self.cluster.hardware, self.cluster
        head = (f"estimate: {self.mesh!r} on {cl.nodes} x {cl.devices_per_node} {hw.name}, "
                f"overlap={self.overlap!r}" + ("" if self.fusion else ", fusion=False"))
        width = max([5] + [len(r[0]) for r in self.layers()])
        lines = [head, f"{'layer':<{width}}  {'compute ms':>11}  {'comm ms':>9}  {'exposed ms':>10}  {'TFLOP':>9}"]
        for name, comp, comm, exposed, flops in self.layers() + [
                ("total", self.compute_time, self.comm_time, self.exposed_comm, self.flops)]:
            lines.append(f"{name:<{width}}  {comp * 1e3:>11.3f}  {comm * 1e3:>9.3f}  {exposed * 1e3:>10.3f}  "
                         f"{flops / 1e12:>9.3f}")
        lines.append(f"step {self.step_time * 1e3:.3f} ms | {self.tflops_per_device:.1f} TFLOP/s per device | "
                     f"MFU {self.mfu:.1%} of {self.peak_flops / 1e12:g} TFLOP/s {self.peak_dtype} | "
                     f"exposed comm {self.exposed_comm * 1e3:.3f} ms (gradients {self.exposed_grad_comm * 1e3:.3f})")
        mem = self.memory
        if mem.fits is None:
            lines.append("memory: not recorded")
        else:
            top = max(mem.peak.values(), default=0)
            lines.append(f"memory: peak {top / 2**30:.2f} GiB of {mem.capacity / 2**30:.2f} GiB per device "
                         f"({'fits' if mem.fits else 'DOES NOT FIT'})")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (f"Report(step_time={self.step_time:.6g}, exposed_comm={self.exposed_comm:.6g}, "
                f"tflops_per_device={self.tflops_per_device:.4g}, mfu={self.mfu:.4g}, mesh={self.mesh!r})")

    def to_chrome_trace(self, path: str | None = None, devices: Sequence[int] | None = None) -> dict:
        """Chrome trace event JSON (opens in Perfetto): per track a process with a ``compute`` and a ``comm``
        thread, "X" events with ``ts``/``dur`` in microseconds spanning ``step_time``. By default one track per
        distinct timeline, named by the devices that share it (every device runs the same SPMD program, so
        16,384 devices are one track, ``"devices 0-16383"``, its process id the first of them and the full list
        in its ``args``): writing every device's copy took 2.28 GB for 1,024 devices. ``devices=[...]`` gives
        those devices' own tracks (``"device d"``, process id ``d``). Written to ``path`` if given."""
        if devices is None:
            groups: dict[int, tuple[Timeline, list[int]]] = {}
            for d in self.devices:
                tl = self.device_timeline(d)
                groups.setdefault(id(tl), (tl, []))[1].append(d)
            tracks = [(f"devices {abbreviate(_runs(ds))}" if len(ds) > 1 else f"device {ds[0]}", min(ds), ds, tl)
                      for tl, ds in groups.values()]
        else:
            tracks = [(f"device {d}", d, [d], self.device_timeline(d)) for d in dict.fromkeys(devices)]
        tid = {"compute": 0, "comm": 1}
        events: list[dict] = []
        for name, pid, ds, tl in tracks:
            events.append({"name": "process_name", "ph": "M", "pid": pid,
                           "args": {"name": name, "devices": ", ".join(_runs(ds)), "count": len(ds)}})
            events.extend({"name": "thread_name", "ph": "M", "pid": pid, "tid": t, "args": {"name": n}}
                          for n, t in tid.items())
            events.extend({"name": iv.name, "cat": iv.stream, "ph": "X", "pid": pid, "tid": tid[iv.stream],
                           "ts": iv.start * 1e6, "dur": (iv.end - iv.start) * 1e6,
                           "args": {"step": iv.step, "layer": iv.layer, "user": iv.user}}
                          for iv in tl.intervals)
        trace = {"traceEvents": events, "displayTimeUnit": "ms",
                 "otherData": {"step_time_us": self.step_time * 1e6, "overlap": self.overlap}}
        if path is not None:
            with open(path, "w") as f:
                json.dump(trace, f)
        return trace

    def plot(self, path: str | None = None):
        """Memory over the step (when recorded per step; else peak by kind) above the timeline of both
        streams. Needs matplotlib (extras ``plot`` and ``plan``); returns the figure, saved to ``path`` if given."""
        try:
            import matplotlib.pyplot as plt  # noqa: PLC0415 - an optional extra, loaded only when plotting
        except ImportError:
            raise ShardingError("plot needs matplotlib: pip install 'nabla-spmd[plot]' (in a clone: pip install -e "
                                "'.[plot]')") from None

        fig, (ax_mem, ax_tl) = plt.subplots(2, 1, figsize=(10, 5), sharex=bool(self.memory.live))
        ends = _step_ends(self.timeline)
        if self.memory.live and len(self.memory.live) == len(ends):
            ax_mem.step([e * 1e3 for e in ends], [b / 2**30 for b in self.memory.live], where="post")
            ax_mem.axhline(self.memory.capacity / 2**30, color="red", linestyle="--", label="HBM")
            ax_mem.set_ylabel("live GiB")
        elif self.memory.by_kind:
            kinds = sorted(self.memory.by_kind)
            ax_mem.bar(kinds, [max(self.memory.by_kind[k].values(), default=0) / 2**30 for k in kinds])
            ax_mem.set_ylabel("peak GiB")
        else:
            ax_mem.text(0.5, 0.5, "memory not recorded", ha="center", va="center", transform=ax_mem.transAxes)
        for y, stream, color in ((1, "compute", "tab:blue"), (0, "comm", "tab:orange")):
            spans = [(iv.start * 1e3, (iv.end - iv.start) * 1e3) for iv in self.timeline.intervals
                     if iv.stream == stream]
            ax_tl.broken_barh(spans, (y - 0.4, 0.8), color=color)
        ax_tl.set_yticks([0, 1], ["comm", "compute"])
        ax_tl.set_xlabel("ms")
        ax_tl.set_xlim(0, max(self.step_time * 1e3, 1e-9))
        fig.suptitle(f"{self.cluster.hardware.name}: step {self.step_time * 1e3:.3f} ms, MFU {self.mfu:.1%}")
        if path is not None:
            fig.savefig(path)
            plt.close(fig)
        return fig


def _runs(ids: Sequence[int]) -> list[str]:
    """Device ids as runs: ``["0-3", "8-11"]`` (sorted)."""
    runs: list[list[int]] = []
    for d in sorted(ids):
        if runs and d == runs[-1][1] + 1:
            runs[-1][1] = d
        else:
            runs.append([d, d])
    return [f"{a}-{b}" if b > a else f"{a}" for a, b in runs]


def _step_ends(timeline: Timeline) -> list[float]:
    """When each step's last interval ends (the time its memory change is in force)."""
    ends = [0.0] * len(timeline.costs)
    for iv in timeline.intervals:
        ends[iv.step] = max(ends[iv.step], iv.end)
    for i in range(1, len(ends)):
        ends[i] = max(ends[i], ends[i - 1])
    return ends


def step_time(steps: Sequence[StepLike], cluster: Cluster, mesh: DeviceMesh, overlap: Any = "grads") -> float:
    """``estimate_steps(...).step_time`` alone: no timeline kept, no memory report, no second layout for the
    gradient sums' share (what autoshard's search compares, once per candidate, hundreds of times)."""
    steps = tuple(steps)
    cluster.tier(mesh, ())
    return step_end(steps, kernel_times(steps, cluster.hardware, True), cluster, mesh, overlap, False, {})


def estimate_steps(steps: Iterable[StepLike], cluster: Cluster, mesh: DeviceMesh, overlap: Any = "grads",
                   model_flops: float | None = None, memory: Any = None, peak_dtype: Any = None,
                   fusion: bool = True) -> Report:
    """Price recorded ``steps`` (program order) of one SPMD training step on ``cluster``'s devices laid out as
    ``mesh``. ``model_flops`` (per device; default every step's FLOPs) is what MFU counts: pass the FLOPs of
    forward plus backward without recomputation. ``memory`` is a memory record (see ``MemoryReport.of``).
    ``peak_dtype`` (default: the dtype carrying the most matmul FLOPs, else float32) sets MFU's peak.
    ``fusion`` (default on): each chain of elementwise steps is priced as one kernel, as a compiler or
    hand-fused kernels run it (``nabla/plan/fusion.py``); ``False`` prices every step as its own kernel."""
    steps = tuple(steps)
    cluster.tier(mesh, ())  # the mesh's devices must be the cluster's
    if not isinstance(fusion, bool):
        raise ShardingError(f"estimate: fusion must be True or False, got {fusion!r}")
    kernels = kernel_times(steps, cluster.hardware, fusion)
    durations: dict = {}
    timeline = simulate(steps, cluster, mesh, overlap, kernels=kernels, durations=durations)
    without = step_end(steps, kernels, cluster, mesh, overlap, True, durations)
    flops = sum(int(s.flops) for s in steps)
    if peak_dtype is None:
        by_dtype: dict[str, int] = {}
        for s in steps:
            if s.op in MATMUL_OPS:
                by_dtype[dtype_key(s.out_dtype)] = by_dtype.get(dtype_key(s.out_dtype), 0) + int(s.flops)
        peak_dtype = max(by_dtype, key=by_dtype.get) if by_dtype else "float32"
    peak_dtype = dtype_key(peak_dtype)
    cluster.hardware.peak(peak_dtype)  # validates
    if model_flops is None:
        model_flops = flops
    elif not isinstance(model_flops, (int, float)) or isinstance(model_flops, bool) or model_flops < 0:
        raise ShardingError(f"estimate: model_flops must be a number >= 0 (FLOPs per device), got {model_flops!r}")
    return Report(timeline, cluster, mesh, overlap, flops, float(model_flops), peak_dtype,
                  timeline.step_time - without, MemoryReport.of(memory, cluster.hardware.hbm_bytes),
                  fusion)
