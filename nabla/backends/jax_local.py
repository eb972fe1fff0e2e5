"""The per-device backend (``jax_local``): one device's block inside ``jax.shard_map``, what ``nb.jit``'s
program runs on. The interpreter's jobs are the grid backends' (``grid``), done to one block: placing cuts this
device's part of a host value, adding once keeps it on coordinate 0 only, and each planned move is its
registry entry's ``jax.lax`` twin. It also tells lowerings where the device is (``linear``, ``pairs``)."""

from __future__ import annotations

from math import prod
from typing import Any, Callable

import numpy as np

from .. import collectives as C
from ..dtypes import identity
from ..errors import ShardingError
from ..layout import chunk, grid, merge_cuts, spec_cuts
from ..mesh import AxisRef
from ..opdef import Local
from ..spec import ShardingSpec
from .base import Backend
from .grid import fit


def mesh_atoms(mesh: Any, cuts: tuple) -> tuple[AxisRef, ...]:
    """The mesh's axes cut at every sub-axis boundary in ``cuts`` (one jax mesh axis each), major to minor."""
    atoms = []
    for name, n, c in zip(mesh.axis_names, mesh.shape, cuts):
        pts = sorted(set(c) | {1, n})
        atoms += [AxisRef(name, a, b // a, n) for a, b in zip(pts, pts[1:])]
    return tuple(atoms)


class JaxLocalBackend(Backend):
    """One device's block under ``shard_map`` over a jax mesh with one axis per atom (``names``)."""

    name = "jax_local"

    def __init__(self, mesh: Any, atoms: tuple[AxisRef, ...], names: tuple[str, ...]) -> None:
        import jax
        self.lax = jax.lax
        self._xp = jax.numpy
        self.mesh, self.atoms, self.names = mesh, atoms, names

    @property
    def xp(self) -> Any:
        return self._xp

    # -- where this device is --
    def axis_names(self, refs) -> tuple[str, ...]:
        """The jax mesh axes (atoms) that make up ``refs``, major to minor."""
        out = []
        for r in refs:
            for a, n in zip(self.atoms, self.names):
                if a.name == r.name and r.pre <= a.pre and a.pre * a.size <= r.pre * r.size:
                    out.append(n)
        return tuple(out)

    def linear(self, refs):
        """This device's position along ``refs`` (mixed radix, major first)."""
        names = self.axis_names(refs)
        return self.lax.axis_index(names) if names else 0

    def position(self):
        return self.lax.axis_index(self.names) if self.names else 0

    def pairs(self, fn: Callable[[int], int | None], refs) -> list[tuple[int, int]]:
        """(source, target) mesh positions: each device sends to the one whose position along ``refs`` is
        ``fn`` of its own, all else equal (targets outside the axis are dropped)."""
        mesh = self.mesh
        k = prod(r.size for r in refs)
        out = []
        for u, d in enumerate(mesh.devices):
            coords = list(mesh.coords(d))
            q = 0
            for r in refs:
                q = q * r.size + r.coord(coords[mesh.axis_index(r.name)])
            t = fn(q)
            if t is None or not 0 <= t < k:
                continue
            new = list(coords)
            rest = t
            for r in reversed(refs):
                digit = rest % r.size
                rest //= r.size
                i = mesh.axis_index(r.name)
                new[i] += (digit - r.coord(new[i])) * r.minor
            out.append((u, mesh.devices.index(mesh.device_at(new))))
        return out

    def ppermute(self, x, pairs):
        """Device ``u`` sends ``x`` to ``v`` for each pair; a device no one sends to receives zeros."""
        if not self.names:
            return x
        return self.lax.ppermute(x, self.names, perm=pairs)

    def first(self, refs):
        """Whether this device is on coordinate 0 of every axis in ``refs``."""
        out = self.xp.asarray(True)
        for r in refs:
            out = out & (self.linear([r]) == 0)
        return out

    # -- the interpreter's jobs --
    def place(self, value: Any, spec: ShardingSpec) -> Any:
        xp = self.xp
        x = xp.asarray(value)
        for d, (refs, n) in enumerate(zip(spec.dim_refs, x.shape)):
            k = prod(r.size for r in refs)
            if k == 1:
                continue
            c = chunk(n, k)
            x = fit(x, d, k * c, xp)
            x = self.lax.dynamic_slice_in_dim(x, self.linear(refs) * c, c, axis=d)
        if spec.partial_axes:  # the whole value on coordinate 0 of each partial group, the identity elsewhere
            x = xp.where(self.first(spec.partial_refs), x, xp.asarray(identity(x.dtype), dtype=x.dtype))
        return x

    def add_once(self, x: Any, spec: ShardingSpec, axes: tuple[str, ...], zero: Any = None) -> Any:
        fill = identity(x.dtype) if zero is None else x.dtype.type(zero)
        return self.xp.where(self.first([spec.mesh.axis_ref(a) for a in axes]), x, self.xp.asarray(fill, dtype=x.dtype))

    def move(self, x: Any, plan: Any, shape: tuple[int, ...] = (), reduce_op: str = "sum",
             skip: tuple[str, ...] = ()) -> Any:
        """(``skip``: step kinds left out, as a bucket leaves its all_reduce to one fused psum.)"""
        for seg in plan.segments:
            for s in seg.steps:
                if s.fused or s.kind in skip:
                    continue
                c = C.REGISTRY.get(s.kind)
                if c is None or c.lower is None:
                    raise ShardingError(f"jit: the collective {s.kind!r} has no jax.lax lowering, so a plan using it "
                                        f"cannot be compiled; give its registry entry one "
                                        f"(Collective(..., lower=fn), fn(block, step, ctx) -> block)")
                x = c.lower(x, s, StepContext(self, [seg.atoms[a] for a in s.atoms], tuple(shape), reduce_op))
        return x

    def regrid(self, x: Any, shape: tuple[int, ...]) -> Any:
        return x

    def local(self, step: Any, x: Any) -> Any:
        if step.lower is None:
            raise ShardingError("jit: a factor kind's local step has no lowering")
        return step.lower(x, self)

    def bucket(self, entry: Any, blocks: list, plans: tuple, shapes: list) -> list:
        """(The plans' local cuts first, their all_reduce left out: a sum commutes with them; then one psum of the
        blocks flattened.)"""
        moved = [self.move(x, p, shape, skip=("all_reduce",)) for x, p, shape in zip(blocks, plans, shapes)]
        names = self.axis_names([seg.atoms[a] for p in plans[:1] for seg in p.segments for s in seg.steps
                                 if s.kind == "all_reduce" for a in s.atoms])
        return entry.lower(moved, names, self)

    def kernel(self, op: Any, arrays: list, prog: Any) -> Any:
        """(The kernel sees one block, ``G`` 0, and this device's part of the op's per-layout constants.)"""
        xp = self.xp
        aux = tuple(self.aux(a, prog) for a in prog.local.aux)
        out = xp.asarray(op.kernel(arrays, Local(0, prog.local.out_chunk, prog.local.params, True, aux)))
        if out.dtype != prog.dtype:
            out = out.astype(prog.dtype)
        if tuple(out.shape) != prog.local.out_chunk:
            out = xp.broadcast_to(out, prog.local.out_chunk)
        if prog.post is not None:
            out = self.move(out, prog.post, prog.result_shape, op.reduction)
        return out

    def aux(self, a: Any, prog: Any) -> Any:
        """This device's part of a per-layout constant shaped (*grid of the op's atoms, ...)."""
        if not isinstance(a, np.ndarray):
            return a
        specs = [p.target for p in prog.preps if p.target is not None] + [prog.kspec]
        cut_grid = grid(prog.kspec, merge_cuts(*(spec_cuts(s) for s in specs)))
        if a.ndim < len(cut_grid.shape):
            return self.xp.asarray(a)
        idx = tuple(self.linear([atom]) if a.shape[j] > 1 else 0 for j, atom in enumerate(cut_grid.atoms))
        return self.xp.asarray(a)[idx]


class StepContext:
    """What a collective's lowering (``Collective.lower``) sees: jax, this device, the step's mesh atoms."""

    def __init__(self, dev: JaxLocalBackend, refs, shape: tuple[int, ...], reduce_op: str) -> None:
        self.lax, self.xp, self.dev = dev.lax, dev.xp, dev
        self.refs = refs
        self.names = dev.axis_names(refs)
        self.k = prod(r.size for r in refs)
        self.shape = shape
        self.reduce_op = reduce_op

    def index(self):
        """This device's position along the step's atoms (mixed radix, major first)."""
        return self.dev.linear(self.refs)

    def fit(self, x, axis: int, n: int):
        return fit(x, axis, n, self.xp)

    def __getattr__(self, name: str):
        """The rest is the device's (``linear``, ``position``, ``pairs``, ``ppermute``, ``axis_names``)."""
        return getattr(self.dev, name)
