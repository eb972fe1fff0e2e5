"""``nb.memory_log()``: bytes per device, live and at their peak, read from the recorded steps as they run (eager or
``nb.abstract``): a value is allocated by the step that makes it and freed when the program drops it; the blocks a
step moves are buffers alive while it runs. Kinds say what a value is to the program (a parameter, its gradient,
optimizer state, a value kept for the backward pass, a temporary, a communication buffer)."""

from __future__ import annotations

import contextlib
import weakref
from functools import lru_cache
from math import prod
from typing import Any, Iterator, Sequence

import numpy as np

from .. import collectives as C
from ..spec import ShardingSpec
from ..step import BUCKET, RELAYOUT
from ..step import serial

KINDS = ("params", "grads", "optimizer", "activations", "temporaries", "comm")


class _Device:
    """Bytes on a set of devices (a mesh's): one number where every device holds the same, else an array."""

    __slots__ = ("ids", "index")

    def __init__(self, devices: Sequence[int]) -> None:
        self.ids = tuple(devices)
        self.index = {d: i for i, d in enumerate(self.ids)}


def _per_device(spec: Any, shape: tuple[int, ...], itemsize: int) -> tuple[Any, Any]:
    """(mesh, bytes each device holds): an int when every device holds as much, else an array in mesh order
    (cached per layout: a program's thousands of values have a few hundred)."""
    if isinstance(spec, ShardingSpec):
        return _count_cached(spec, tuple(shape), itemsize)
    return _count(spec, shape, itemsize)


def _count(spec: Any, shape: tuple[int, ...], itemsize: int) -> tuple[Any, Any]:
    if spec is None or not isinstance(spec, ShardingSpec):
        mesh = getattr(spec, "mesh", None)
        return mesh, prod(shape) * itemsize  # a host value (mesh None) or a per-device block of this shape
    mesh = spec.mesh
    counts = [spec.num_shards(d) for d in range(len(shape))]
    if all(n % k == 0 for n, k in zip(shape, counts)):
        return mesh, prod(n // k for n, k in zip(shape, counts)) * itemsize
    return mesh, _uneven(spec, shape) * itemsize


_count_cached = lru_cache(maxsize=8192)(_count)


def _uneven(spec: ShardingSpec, shape: tuple[int, ...]) -> np.ndarray:
    """Elements of each device's block (the ceil rule), in mesh device order."""
    mesh = spec.mesh
    coords = np.array([mesh.coords(d) for d in mesh.devices], dtype=np.int64).reshape(len(mesh.devices), -1)
    out = np.ones(len(mesh.devices), dtype=np.int64)
    for refs, n in zip(spec.dim_refs, shape):
        k = prod(r.size for r in refs)
        if k == 1:
            out *= n
            continue
        pos = np.zeros(len(mesh.devices), dtype=np.int64)
        for r in refs:
            pos = pos * r.size + (coords[:, mesh.axis_index(r.name)] // r.minor) % r.size
        c = -(-n // k)
        out *= np.clip(n - pos * c, 0, c)
    return out


class MemoryLog:
    """Per device id: ``peak[d]`` (the most bytes live at once), ``live[d]`` (live now), ``by_kind[kind][d]`` (the
    most bytes of that kind live at once), and ``timeline`` (one device's live bytes after each step)."""

    def __init__(self) -> None:
        self._meshes: dict[Any, dict] = {}  # mesh -> its accounts
        self._owned: dict[int, tuple] = {}  # serial -> (mesh, bytes, kind, objects alive)
        self._tags: dict[int, str] = {}
        # (serial, id of a live object holding it) -> a weak reference whose callback drops it (kept here: a
        # weakref.ref with a callback costs a fraction of a weakref.finalize, and dies with the log)
        self._objects: dict[tuple[int, int], Any] = {}
        self.timeline: list[int] = []
        self.host_bytes = 0  # values on no mesh (host arrays): every device of a run can read them

    # -- accounts --
    def _acct(self, mesh: Any) -> dict:
        a = self._meshes.get(mesh)
        if a is None:
            n = len(mesh.devices)
            a = self._meshes[mesh] = {"live": {k: 0 for k in KINDS}, "peak": {k: 0 for k in KINDS}, "total": 0,
                                      "n": n, "uneven": False}
        return a

    def _add(self, mesh: Any, kind: str, nbytes: Any) -> None:
        if mesh is None:
            self.host_bytes += int(np.sum(nbytes))
            return
        a = self._acct(mesh)
        live, peak = a["live"], a["peak"]
        now = live[kind] = live[kind] + nbytes
        if not a["uneven"] and isinstance(nbytes, (int, np.integer)):  # every device alike (most programs)
            if now > peak[kind]:
                peak[kind] = now
            total = sum(live.values())
            if total > a["total"]:
                a["total"] = total
            return
        a["uneven"] = True
        peak[kind] = np.maximum(peak[kind], now)
        a["total"] = np.maximum(a["total"], sum(live[k] for k in KINDS))

    def _sub(self, mesh: Any, kind: str, nbytes: Any) -> None:
        if mesh is None:
            self.host_bytes -= int(np.sum(nbytes))
            return
        a = self._acct(mesh)
        a["live"][kind] = a["live"][kind] - nbytes

    # -- what the program does --
    def tag(self, value: Any, kind: str) -> None:
        """Say what ``value`` is (``params``, ``grads``, ``optimizer``); a value seen before changes account."""
        s = serial(value)
        self._tags[s] = kind
        own = self._owned.get(s)
        if own is None:  # made without a step (zeros of the optimizer's state): held from now on
            if getattr(value, "_shape", None) is not None:
                self._hold(s, value, kind)
        elif own[2] != kind:
            mesh, nbytes, old, alive = own
            self._sub(mesh, old, nbytes)
            self._add(mesh, kind, nbytes)
            self._owned[s] = (mesh, nbytes, kind, alive)

    def _hold(self, s: int, v: Any, kind: str) -> None:
        mesh, nbytes = _per_device(v._spec, v._shape, v._dtype.itemsize)
        kind = self._tags.get(s, kind)
        self._add(mesh, kind, nbytes)
        self._owned[s] = (mesh, nbytes, kind, 1)
        self._watch(s, v)

    def _watch(self, s: int, v: Any) -> None:
        """Drop ``v``'s hold on value ``s`` when the program lets go of it."""
        key = (s, id(v))
        self._objects[key] = weakref.ref(v, lambda _, s=s, o=key[1]: self._drop(s, o))

    def _drop(self, s: int, obj: int) -> None:
        self._objects.pop((s, obj), None)
        own = self._owned.get(s)
        if own is None:
            return
        mesh, nbytes, kind, alive = own
        if alive > 1:
            self._owned[s] = (mesh, nbytes, kind, alive - 1)
            return
        del self._owned[s]
        self._sub(mesh, kind, nbytes)

    def take(self, step: Any, values: Sequence[tuple[int, Any]] = ()) -> None:
        """A step ran: its operands are held (values made before the log opened count from here), the blocks it
        moved are buffers for the step's duration, its result is allocated."""
        n_in = len(step.uses) if step.op == BUCKET else max(len(values) - 1, 0)
        ins, outs = values[:n_in], values[n_in:]
        seen = {id(v) for _, v in ins}
        for s, v in ins:
            if s and getattr(v, "_shape", None) is not None and not self._has(s, v):
                self._hold(s, v, "activations")
        buffers = []
        for u in step.uses if step.op not in (RELAYOUT, BUCKET) else ():  # (their moved blocks are their result)
            if u.events and u.value:
                mesh, nbytes = _per_device(u.dst, u.shape, u.dtype.itemsize)
                buffers.append((mesh, nbytes))
        for mesh, nbytes in buffers:
            self._add(mesh, "comm", nbytes)
        for s, out in outs:
            if s and id(out) not in seen and not self._has(s, out):
                phase_kind = "activations" if step.phase == "forward" and _diff(out) else "temporaries"
                self._hold(s, out, phase_kind)
        for mesh, nbytes in buffers:
            self._sub(mesh, "comm", nbytes)
        self.timeline.append(self._now())

    def _has(self, s: int, v: Any) -> bool:
        """Whether value ``v`` (serial ``s``) is accounted for already; a new object of a known value (a twin
        sharing its blocks) is held too, so the bytes go when the last of them does."""
        own = self._owned.get(s)
        if own is None:
            return False
        key = (s, id(v))
        if key not in self._objects:
            self._owned[s] = own[:3] + (own[3] + 1,)
            self._watch(s, v)
        return True

    def _now(self) -> int:
        for a in self._meshes.values():
            live = sum(a["live"][k] for k in KINDS)
            return int(np.max(live)) if not isinstance(live, (int, np.integer)) else int(live)
        return 0

    # -- reading --
    def _per_id(self, pick) -> dict[int, int]:
        out: dict[int, int] = {}
        for mesh, a in self._meshes.items():
            got = pick(a)
            if isinstance(got, (int, np.integer)):
                out.update({d: int(got) for d in mesh.devices})
            else:
                out.update({d: int(b) for d, b in zip(mesh.devices, np.broadcast_to(got, (a["n"],)))})
        return out

    @property
    def peak(self) -> dict[int, int]:
        """Device id -> the most bytes live on it at once."""
        return self._per_id(lambda a: a["total"])

    @property
    def live(self) -> dict[int, int]:
        """Device id -> the bytes live on it now."""
        return self._per_id(lambda a: sum(a["live"][k] for k in KINDS))

    @property
    def by_kind(self) -> dict[str, dict[int, int]]:
        """Kind -> device id -> the most bytes of that kind live at once."""
        return {k: self._per_id(lambda a, k=k: a["peak"][k]) for k in KINDS}

    def summary(self) -> str:
        """One row per kind: the most bytes any device held of it, then the peak and what is live now."""
        by = self.by_kind
        rows = [("kind", "peak bytes/device")] + [(k, f"{max(by[k].values(), default=0):,}") for k in KINDS]
        rows.append(("peak (all kinds at once)", f"{max(self.peak.values(), default=0):,}"))
        rows.append(("live now", f"{max(self.live.values(), default=0):,}"))
        w = max(len(r[0]) for r in rows)
        return "\n".join(f"{a.ljust(w)}  {b}" for a, b in rows)

    def __str__(self) -> str:
        return self.summary()

    def __repr__(self) -> str:
        return f"MemoryLog(peak {max(self.peak.values(), default=0):,} B/device)"


def _diff(v: Any) -> bool:
    node = getattr(v, "_node", None)
    return node is not None and getattr(node, "diff", False)


@contextlib.contextmanager
def memory_log() -> Iterator[MemoryLog]:
    """Account the bytes of every value the block makes and reads, per device (eager or ``nb.abstract``)."""
    with C.recording(MemoryLog()) as log:
        yield log

