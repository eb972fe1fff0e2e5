"""``nb.memory_log()``: bytes per device, live and at their peak, read from the recorded steps by one liveness pass
(eager, ``nb.abstract``, ``nb.estimate``): a value is allocated by the step that makes it (as stored: padded
blocks; a view shares its source's bytes) and dies after the last step that reads it, unless the program still
holds it when the log closes. What the backward pass keeps is what its VJPs read: the residuals each op declares.
Kinds say what a value is over the whole record (a parameter, its gradient, optimizer state, a value kept for the
backward pass, a temporary, a collective's buffer), not the phase it was made in."""

from __future__ import annotations

import contextlib
import weakref
from functools import lru_cache
from math import prod
from typing import Any, Iterable, Iterator, NamedTuple, Sequence

import numpy as np

from .. import collectives as C
from ..spec import ShardingSpec
from ..step import BUCKET, MOVE, PLACE, RELAYOUT
from ..trace import link_of
from ..value import serial
from .fusion import EXECUTOR_OPS, LOOP_OPS, REDUCE_OPS

KINDS = ("params", "grads", "optimizer", "activations", "temporaries", "comm")
_TAGGED = ("params", "grads", "optimizer")
_MOVES = (RELAYOUT, MOVE, BUCKET, PLACE)  # a value these make is what its source is (a moved gradient: a gradient)
_LATER = {"forward": ("backward", "recompute"), "recompute": ("backward",), "": ("backward", "recompute")}


@lru_cache(maxsize=8192)
def _stored(spec: Any, shape: tuple[int, ...], itemsize: int) -> tuple[Any, int]:
    """(mesh, bytes one device stores) of a value laid out as ``spec``: every device holds its padded block (the
    ceil rule); a per-device value (inside ``nb.shard_map``) is its block; a host value's mesh is None."""
    if isinstance(spec, ShardingSpec):
        return spec.mesh, prod(-(-n // spec.num_shards(d)) for d, n in enumerate(shape)) * itemsize
    return getattr(spec, "mesh", None), prod(shape) * itemsize


def _bytes(spec: Any, shape: Sequence[int], dtype: Any) -> tuple[Any, int]:
    return _stored(spec, tuple(shape), np.dtype(dtype).itemsize)


class Buffer(NamedTuple):
    """One allocation of the record: the value it holds (serial), bytes per device, kind, the step that made it
    (-1: before the first) and the last step it is alive at (the number of steps: held to the end)."""

    value: int
    mesh: Any
    bytes: int
    kind: str
    made: int
    freed: int


class Accounts(NamedTuple):
    """The pass's result, per mesh: the most bytes live at once (``peak``), by kind, held at the end, and one
    device's live bytes at each step (``timeline``, of the first mesh); and every allocation (``buffers``)."""

    peak: dict  # mesh -> bytes
    by_kind: dict  # mesh -> kind -> bytes
    live: dict  # mesh -> bytes
    timeline: list
    buffers: list
    kept: dict  # mesh -> bytes kept for the backward pass when it starts


#: what a broadcast fuses into, as XLA's loop and input fusions take it (a matmul reads it materialised)
_FUSES_BROADCAST = LOOP_OPS | REDUCE_OPS | EXECUTOR_OPS


def fused_broadcasts(steps: Sequence[Any], held: set) -> set[int]:
    """The broadcasts no kernel materialises: read only by elementwise ops, reductions and moves, and not held at
    the end (a loss's gradient broadcast to the activations' global shape and cut at once into each device's
    block is that block, not the global batch on every device)."""
    readers: dict[int, set] = {}
    for st in steps:
        for u in st.uses:
            if u.value:
                readers.setdefault(u.value, set()).add(st.name)
    return {st.out for st in steps if st.name == "broadcast_to" and st.out not in held and
            readers.get(st.out) and readers[st.out] <= _FUSES_BROADCAST}


def account(steps: Sequence[Any], first: dict, tags: dict, made_at: dict, held: set, start: Iterable[int] = (),
            replaces: dict | None = None) -> Accounts:
    """The liveness pass. ``first``: serial -> (layout, shape, dtype) of values the steps read that were made
    before them; ``tags``: serial -> what the program said it is; ``made_at``: serial -> (step index, layout,
    shape, dtype) of values made without a step (an optimizer's zeros); ``held``: serials the program still holds
    at the end; ``start``: serials alive from the start whether read or not (the measured function's arguments);
    ``replaces``: serial -> the serial it is written over (an optimizer's update, in place as PyTorch's is and as
    JAX's with donated buffers: the new state takes the old one's bytes)."""
    n = len(steps)
    buf: list[list] = []  # [mesh, bytes, start, end, root serial, sharer serial or None]
    of: dict[int, int] = {}  # serial -> its buffer
    last: dict[int, int] = {}  # serial -> last step reading it (a pending sum: reading its summands)
    last_sum: dict[int, int] = {}  # serial of a pending sum -> last step reading the sum made of it
    replaces = replaces or {}
    pending: set[int] = set()  # values made as pending sums
    phases: dict[int, set] = {}  # serial -> phases of the steps reading it
    made: dict[int, str] = {}  # serial -> phase of the step that made it
    source: dict[int, int] = {}  # serial -> the serial it was moved from
    transient: dict[tuple, list] = {}  # (mesh, kind) -> [(step, bytes)]
    late = sorted(((i, s) for s, (i, *_) in made_at.items()), reverse=True)
    sized: dict[tuple, tuple] = {}  # (id(layout), shape, dtype) -> (mesh, bytes): the program's few hundred layouts
    keep_alive = []  # (the layouts whose ids key ``sized``)
    copies: dict[tuple, int] = {}  # (serial, layout) -> buffer of the gathered copy made last
    copy_end: dict[int, int] = {}  # buffer of a gathered copy -> the last step reading it
    fused = fused_broadcasts(steps, held)

    def size(layout: Any, shape: Any, dtype: Any) -> tuple[Any, int]:
        key = (id(layout), shape, dtype)
        got = sized.get(key)
        if got is None:
            got = sized[key] = _bytes(layout, shape, dtype)
            keep_alive.append(layout)
        return got

    def alloc(s: int, at: int, layout: Any, shape: Any, dtype: Any, extra: int = 0, tied: int | None = None) -> None:
        mesh, b = size(layout, shape, dtype)
        if mesh is None:
            return
        buf.append([mesh, b + extra, at, at, s, tied])
        if tied is None:
            of[s] = len(buf) - 1

    start_set = set(start)
    for s in start_set:
        if s not in of and s in first:
            alloc(s, -1, *first[s])
    for s, (spec, *_) in first.items():
        if isinstance(spec, ShardingSpec) and spec.partial_axes:
            pending.add(s)
    for i, st in enumerate(steps):
        while late and late[-1][0] <= i:
            at, s = late.pop()
            if s not in of:
                alloc(s, min(at, i), *made_at[s][1:])
        kernel = not isinstance(st.op, str)
        for u in st.uses:
            s = u.value
            if not s:
                continue
            if s not in of:  # made before the steps: alive from the start
                alloc(s, -1, *first.get(s, (u.src, u.shape, u.dtype)))
                if s not in of and isinstance(u.dst, ShardingSpec):  # a host value: on the devices as read
                    alloc(s, -1 if s in start_set else i, u.dst, u.shape, u.dtype)
            phases.setdefault(s, set()).add(st.phase)
            src = u.src
            summands = isinstance(src, ShardingSpec) and src.partial_axes and not u.settled and not u.reused
            if u.reused and (s, u.dst) in copies:
                copy_end[copies[s, u.dst]] = i  # the gathered copy an earlier use made, read again
            elif s in pending and not summands:
                last_sum[s] = i  # the sum made of it before, read again
            else:
                last[s] = i
            if u.kept:  # the moved operand, kept by the op's link for the backward pass
                alloc(u.kept, i, u.dst, u.shape, u.dtype)
                made[u.kept] = st.phase
            elif kernel and u.events and not u.reused:
                if u.cached:  # a gathered copy kept on the value for its later uses: until the last of them
                    alloc(s, i, u.dst, u.shape, u.dtype, tied=-s)
                    copies[s, u.dst] = copy_end[len(buf) - 1] = len(buf) - 1
                elif summands:
                    alloc(s, i, u.dst, u.shape, u.dtype, tied=s)  # a summed copy, kept on the value for later uses
                else:
                    mesh, b = size(u.dst, u.shape, u.dtype)
                    if mesh is not None:
                        transient.setdefault((mesh, "comm"), []).append((i, b))
        if st.op == MOVE:  # a pending sum made once for later uses: a copy kept as long as it is read
            u = st.uses[0]
            if u.events and not u.reused:
                alloc(u.value, i, st.out_spec, st.out_shape, st.out_dtype, tied=u.value)
            continue
        if isinstance(st.out_spec, ShardingSpec) and st.out_spec.partial_axes:
            pending.add(st.out)
        if st.op == BUCKET:
            for u, target, s in zip(st.uses, st.params[0], st.params[1]):
                alloc(s, i, target, u.shape, u.dtype)
                made[s], source[s] = st.phase, u.value
            continue
        s = st.out
        if s in of:
            continue
        if st.alias and st.alias in of:
            of[s] = of[st.alias]
        elif s in fused and st.uses[0].value in of:  # fused into its readers: no buffer of its own
            of[s] = of[st.uses[0].value]
        else:
            alloc(s, i, st.out_spec, st.out_shape, st.out_dtype, st.extra)
        made[s] = st.phase
        if st.op in _MOVES and st.uses and st.uses[0].value:
            source[s] = st.uses[0].value
    while late:
        _, s = late.pop()
        if s not in of:
            alloc(s, n - 1, *made_at[s][1:])

    # a value written over another (an update in place) takes its bytes: its buffer is the one it replaces
    for s, old in replaces.items():
        kn, ko = of.get(s), of.get(old)
        if kn is None or ko is None or kn == ko or buf[kn][:2] != buf[ko][:2] or buf[kn][2] < buf[ko][2]:
            continue
        for v, k in list(of.items()):
            if k == kn:
                of[v] = ko
        buf[kn][1] = 0

    # ends: after the last read of any value sharing the buffer, or the end when the program holds one
    ends = [b[2] for b in buf]
    for s, k in of.items():
        e = n if s in held else last.get(s, -2)
        if e > ends[k]:
            ends[k] = e
    for k, b in enumerate(buf):
        if b[5] is not None and b[5] > 0:  # a summed copy: until its last read (the end, when its value is held)
            ends[k] = max(ends[k], n if b[5] in held else last_sum.get(b[5], -2))
    for k, e in copy_end.items():  # a gathered copy: until its last read, as a compiled program frees it
        ends[k] = e

    def kind_of(s: int) -> str:
        seen = 0
        while s and seen < 64:
            t = tags.get(s)
            if t is not None:
                return t
            s, seen = source.get(s, 0), seen + 1
        return ""

    sharers: dict[int, list[int]] = {}
    for s, k in of.items():
        sharers.setdefault(k, []).append(s)
    kinds = []
    for k, b in enumerate(buf):
        root = abs(b[5]) if b[5] is not None else b[4]
        names = sharers.get(of.get(root, k), [root]) if b[5] is not None else sharers.get(k, [root])
        kind = ""
        for s in names:  # (the first sharer's that has one, each asked once)
            kind = kind_of(s)
            if kind:
                break
        if not kind:
            when = made.get(root, "")
            later = _LATER.get(when, ())
            read = {p for s in names for p in phases.get(s, ())}
            # kept for the backward pass: read by it, and made (or, an argument, read) before it; an argument the
            # backward pass alone reads (a cotangent handed in) arrives with it
            kept = bool(read & set(later)) and (when != "" or "forward" in read)
            kind = "activations" if kept else "temporaries"
        kinds.append(kind)

    # the sweep: per mesh and kind, bytes allocated before each step and freed after it
    t = n + 1  # slot 0: before the first step; slot i + 1: step i
    series: dict[Any, np.ndarray] = {}
    for k, b in enumerate(buf):
        mesh = b[0]
        arr = series.get(mesh)
        if arr is None:
            arr = series[mesh] = np.zeros((len(KINDS), t + 1), dtype=np.int64)
        row = KINDS.index(kinds[k])
        arr[row, b[2] + 1] += b[1]
        arr[row, min(ends[k], n) + 2 if ends[k] < n else t] -= b[1]
    for (mesh, kind), items in transient.items():
        arr = series.get(mesh)
        if arr is None:
            arr = series[mesh] = np.zeros((len(KINDS), t + 1), dtype=np.int64)
        row = KINDS.index(kind)
        for i, b in items:
            arr[row, i + 1] += b
            arr[row, i + 2] -= b
    peak, by_kind, live, timeline = {}, {}, {}, []
    for mesh, arr in series.items():
        level = np.cumsum(arr[:, :t], axis=1)  # bytes of each kind live during each slot
        total = level.sum(axis=0)
        peak[mesh] = int(total.max(initial=0))
        by_kind[mesh] = {kd: int(level[r].max(initial=0)) for r, kd in enumerate(KINDS)}
        live[mesh] = int(sum(b[1] for k, b in enumerate(buf) if b[0] == mesh and ends[k] >= n))
        if not timeline:
            timeline = [int(x) for x in total[1:]]
    buffers = [Buffer(abs(b[5]) if b[5] is not None else b[4], b[0], b[1], kinds[k], b[2], min(ends[k], n))
               for k, b in enumerate(buf)]
    turn = next((i for i, st in enumerate(steps) if st.phase in ("backward", "recompute")), n)
    kept: dict = {mesh: 0 for mesh in series}
    for b in buffers:
        if b.kind == "activations" and b.made < turn <= b.freed:
            kept[b.mesh] += b.bytes
    return Accounts(peak, by_kind, live, timeline, buffers, kept)


class MemoryLog:
    """Per device id: ``peak[d]`` (the most bytes live at once), ``live[d]`` (held when the log closed),
    ``by_kind[kind][d]`` (the most bytes of that kind live at once), ``kept[d]`` (kept for the backward pass as it
    starts), ``timeline`` (one device's live bytes at each recorded step) and ``buffers()`` (every allocation). Read from the steps recorded while the log was open (a recorder: ``nb.comm_log``'s
    steps are the same), by ``account``; reading it while the log is open counts what is held then."""

    def __init__(self) -> None:
        self.steps: list = []
        self._tags: dict[int, str] = {}
        self._first: dict[int, tuple] = {}  # serial -> its layout when first seen
        self._made_at: dict[int, tuple] = {}
        self._refs: dict[int, list] = {}  # serial -> weak references to the objects holding it
        self._start: dict[int, None] = {}
        self._replaces: dict[int, int] = {}
        self._held: set | None = None  # fixed when the log closes
        self._cache: tuple | None = None

    # -- what the program does --
    def take(self, step: Any, values: Sequence[tuple[int, Any]] = ()) -> None:
        """A step ran: keep it, and watch the objects holding its operands and result (alive at the end: held)."""
        self.steps.append(step)
        self._cache = None
        for s, v in values:
            if s:
                self._watch(s, v)
        if step.saves and values:  # what the op's link on the tape keeps for the backward pass holds those values too
            kept = link_of(values[-1][1])
            if kept is not None:
                for a in kept.args + (kept.out,):
                    s = getattr(a, "_serial", None)
                    if s:
                        self._watch(s, a)

    def _watch(self, s: int, v: Any) -> None:
        refs = self._refs.get(s)
        if refs is None:
            self._refs[s] = [weakref.ref(v)]
            if s not in self._first and getattr(v, "_shape", None) is not None:
                self._first[s] = (v._spec, v._shape, v._dtype)
        elif len(refs) < 8:
            for r in refs:  # (a loop, not all(): this runs for every operand of every step)
                if r() is v:
                    return
            refs.append(weakref.ref(v))

    def tag(self, value: Any, kind: str) -> None:
        """Say what ``value`` is (``params``, ``grads``, ``optimizer``), whenever it was made."""
        s = serial(value)
        if not s:
            return
        self._tags[s] = kind
        self._cache = None
        if getattr(value, "_shape", None) is None:
            return
        if s not in self._refs:  # made without a step
            at = len(self.steps) if self.steps else -1  # (before any step: it was there from the start)
            self._made_at[s] = (at, value._spec, value._shape, value._dtype)
        self._watch(s, value)  # (whoever holds this object holds the value)

    def replace(self, new: Any, old: Any) -> None:
        """``new`` is written over ``old`` (an optimizer's state and parameters, updated in place)."""
        s, o = serial(new), serial(old)
        if s and o and s != o:
            self._replaces[s] = o
            self._cache = None

    def hold(self, values: Iterable[Any]) -> None:
        """Count ``values`` from the start, read or not (the arguments of the function being measured)."""
        for v in values:
            s = serial(v)
            if s and getattr(v, "_shape", None) is not None:
                self._start[s] = None
                self._watch(s, v)
        self._cache = None

    @classmethod
    def of(cls, steps: Sequence[Any], inputs: Sequence[Any], outputs: Sequence[Any]) -> "MemoryLog":
        """The accounts of a recorded program run on its own: ``inputs`` alive from its start, ``outputs`` held at
        its end, every other value until its last reader (``nb.jit``'s compiled program: what XLA keeps)."""
        log = cls()
        log.steps = list(steps)
        for v in inputs:
            s = serial(v)
            if s and getattr(v, "_shape", None) is not None:
                log._first[s] = (v._spec, v._shape, v._dtype)
                log._start[s] = None
        log._held = {serial(o) for o in outputs} | set(log._start)
        return log

    def close(self) -> None:
        """Fix what the program holds at the end: the values some object still carries."""
        self._held = self._alive()
        self._cache = None

    def _alive(self) -> set:
        return {s for s, refs in self._refs.items() if any(r() is not None for r in refs)}

    # -- reading --
    def _accounts(self) -> Accounts:
        if self._cache is None or self._held is None:
            held = self._held if self._held is not None else self._alive()
            self._cache = (account(self.steps, self._first, self._tags, self._made_at, held, self._start,
                                   self._replaces),)
        return self._cache[0]

    def _per_id(self, per_mesh: dict) -> dict[int, int]:
        if len(per_mesh) == 1:  # one mesh (most programs): every device holds as much
            (mesh, b), = per_mesh.items()
            return dict.fromkeys(mesh.devices, int(b))
        out: dict[int, int] = {}
        for mesh, b in per_mesh.items():
            for d in mesh.devices:
                out[d] = out.get(d, 0) + int(b)
        return out

    @property
    def peak(self) -> dict[int, int]:
        """Device id -> the most bytes live on it at once."""
        return self._per_id(self._accounts().peak)

    @property
    def live(self) -> dict[int, int]:
        """Device id -> the bytes the program still held on it when the log closed."""
        return self._per_id(self._accounts().live)

    @property
    def by_kind(self) -> dict[str, dict[int, int]]:
        """Kind -> device id -> the most bytes of that kind live at once."""
        acc = self._accounts().by_kind
        return {k: self._per_id({m: v[k] for m, v in acc.items()}) for k in KINDS}

    @property
    def kept(self) -> dict[int, int]:
        """Device id -> the bytes kept for the backward pass when it starts (what its VJPs will read: Korthikanti
        et al.'s "activation memory"; ``by_kind["activations"]`` also counts values a recompute makes later)."""
        return self._per_id(self._accounts().kept)

    @property
    def timeline(self) -> list[int]:
        """One device's live bytes at each recorded step (collective buffers included)."""
        return self._accounts().timeline

    def buffers(self, at: int | None = None) -> list[Buffer]:
        """Every allocation the pass found (alive at step ``at`` only, when given), largest first: what is held
        at the peak, and why."""
        got = self._accounts().buffers
        if at is not None:
            got = [b for b in got if b.made <= at <= b.freed]
        return sorted(got, key=lambda b: -b.bytes)

    def summary(self) -> str:
        """One row per kind: the most bytes any device held of it, then the peak and what is held at the end."""
        by = self.by_kind
        rows = [("kind", "peak bytes/device")] + [(k, f"{max(by[k].values(), default=0):,}") for k in KINDS]
        rows.append(("peak (all kinds at once)", f"{max(self.peak.values(), default=0):,}"))
        rows.append(("held at the end", f"{max(self.live.values(), default=0):,}"))
        w = max(len(r[0]) for r in rows)
        note = "" if self.peak else "\n(no value was on a mesh: place tensors with .shard(...) to count device memory)"
        return "\n".join(f"{a.ljust(w)}  {b}" for a, b in rows) + note

    def __str__(self) -> str:
        return self.summary()

    def __repr__(self) -> str:
        return f"MemoryLog(peak {max(self.peak.values(), default=0):,} B/device)"


@contextlib.contextmanager
def memory_log() -> Iterator[MemoryLog]:
    """Account the bytes of every value the block makes and reads, per device (eager or ``nb.abstract``)."""
    with C.recording(MemoryLog()) as log:
        try:
            yield log
        finally:
            log.close()
