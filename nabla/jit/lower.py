"""``nb.jit``'s per-device program: the rewritten instructions (``program.py``) interpreted on one device's
blocks inside ``jax.shard_map``: kernels in ``jax.numpy``, each planned move through its registry entry's
``jax.lax`` twin. Reads the recorded steps only; plans nothing."""

from __future__ import annotations

import weakref
from functools import partial
from typing import Any, Callable

import numpy as np

from ..errors import ShardingError
from .. import interpret
from ..value import Value
from ..layout import chunks, grid, merge_cuts, spec_cuts
from ..mesh import DeviceMesh
from ..spec import ShardingSpec
from ..tensor import Tensor
from .program import Key, Rewritten, layout
from ..backends.jax import atom_mesh, atom_name
from ..backends.jax_local import JaxLocalBackend, mesh_atoms


class CompiledProgram:
    """The rewritten instructions as one function of every device's blocks, run under shard_map over a jax mesh
    with one axis per mesh atom: the arguments' blocks, then the constants', in; the results' blocks out."""

    def __init__(self, twins: list, outs: list, rw: Rewritten, values: dict) -> None:
        self.twins, self.outs, self.rw, self.values = twins, outs, rw, values
        self.input_keys = [(t._serial, layout(t._spec)) for t in twins]
        self.out_keys = [_out_key(o, rw) for o in outs]
        self.consts = [(self.const_value(k), k[1]) for k in rw.consts]
        self._const_arrays = self._targets = None
        self.mesh = self._mesh()
        specs = [s for s in [t.sharding for t in twins + outs] + [k[1] for k in rw.consts] if s is not None]
        for ins in rw.instrs:
            specs += [k[1] for k in (ins.writes,) + tuple(r for r in ins.reads if r is not None)]
            prog = ins.step.prog
            if ins.kind == "kernel":
                specs += [p.target for p in prog.preps if p.target is not None] + [prog.kspec, prog.result]
        cuts = merge_cuts(*(spec_cuts(s) for s in specs if isinstance(s, ShardingSpec)))
        if cuts is None:
            raise ShardingError("jit: the sub-axes this function uses do not nest into one jax mesh")
        self.cuts = cuts
        self.atoms = mesh_atoms(self.mesh, cuts)
        self.jmesh = atom_mesh(self.mesh, self.atoms)
        self.names = tuple(atom_name(a) for a in self.atoms)

    def const_value(self, k: Key) -> Value:
        v = self.rw.folded.get(k)
        if v is None:
            v = self.values[k[0]]
            if layout(v._spec) != k[1]:
                raise ShardingError(f"internal: jit constant {k} is laid out {v._spec!r}")
        return v

    def _mesh(self) -> DeviceMesh:
        meshes = {t.sharding.mesh for t in self.twins + self.outs if t.sharding is not None}
        for ins in self.rw.instrs:
            for k in (ins.writes,) + tuple(r for r in ins.reads if r is not None):
                if k[1] is not None:
                    meshes.add(k[1].mesh)
        for _, spec in self.consts:
            if spec is not None:
                meshes.add(spec.mesh)
        if not meshes:  # only host values: the program runs on one device (jax.devices()[0])
            return DeviceMesh("host", (1,), ("host",))
        if len(meshes) != 1:
            raise ShardingError(f"jit: the function uses {len(meshes)} meshes ({', '.join(map(repr, meshes))}); a "
                                f"compiled program runs on one mesh: move values between meshes outside nb.jit")
        return meshes.pop()

    # -- layout of blocks as jax arrays --
    def pspec(self, spec: Any, rank: int):
        from jax.sharding import PartitionSpec
        if spec is None:  # a host value: every device holds all of it
            return PartitionSpec(*([None] * (len(self.atoms) + rank)))
        g = grid(spec, self.cuts)
        return PartitionSpec(*[n if s > 1 else None for n, s in zip(self.names, g.shape)], *([None] * rank))

    def global_array(self, v: Value, spec: ShardingSpec | None):
        """A tensor's stored blocks as the jax global array shard_map splits over the atoms."""
        if spec is None:
            data = np.asarray(v._data)
            return data.reshape((1,) * len(self.atoms) + data.shape)
        data = v._data
        if data is None:
            raise ShardingError("jit: an abstract tensor (nb.abstract) cannot be run; call .lower(...) to plan only")
        shape = grid(spec, self.cuts).shape + data.shape[len(grid(spec).shape):]
        return data if data.shape == shape else data.reshape(shape)

    def inputs(self, leaves: list) -> list:
        """The jax global arrays of the arguments' blocks, then the constants'. A numpy-backed tensor's device
        copy is made once and reused while its (immutable) blocks live; blocks already on their devices (a
        previous call's results, data loaded per process) are used as they are."""
        import jax
        from jax.sharding import NamedSharding
        if self._targets is None:
            self._targets = [NamedSharding(self.jmesh, self.pspec(t.sharding, t.ndim)) for t in self.twins]
        arrays = []
        for t, x, target in zip(self.twins, leaves, self._targets):
            if not isinstance(x, Tensor) or (x._spec is not t._spec and x._spec != t._spec) or x._shape != t._shape:
                raise ShardingError(f"jit: expected a tensor of shape {t.shape} laid out {t.sharding!r}")
            data = x._data
            if data is None:
                raise ShardingError("jit: an abstract tensor (nb.abstract) cannot be run; call .lower(...) to plan "
                                    "only")
            if isinstance(data, jax.Array):
                arr = self.global_array(x, x.sharding)
                if arr.sharding is target or arr.sharding.is_equivalent_to(target, arr.ndim):
                    arrays.append(arr)  # already on its devices
                else:
                    arrays.append(jax.device_put(arr, target))
                continue
            arrays.append(_device_copy(data, lambda x=x: self.global_array(x, x.sharding), target))
        if self._const_arrays is None:
            self._const_arrays = [jax.device_put(self.global_array(value, spec), NamedSharding(
                self.jmesh, self.pspec(spec, len(value._shape)))) for value, spec in self.consts]
        return arrays + self._const_arrays

    def avals(self) -> list:
        """The jax global arrays ``inputs`` gives, as shapes, dtypes and shardings (to trace without data)."""
        import jax
        from jax.sharding import NamedSharding
        out = []
        for spec, shape, dtype in [(t.sharding, t.shape, t.dtype) for t in self.twins] + \
                                  [(spec, v._shape, v._dtype) for v, spec in self.consts]:
            g = (1,) * len(self.atoms) if spec is None else grid(spec, self.cuts).shape
            block = tuple(shape) if spec is None else _block(spec, shape)
            out.append(jax.ShapeDtypeStruct(g + block, dtype,
                                            sharding=NamedSharding(self.jmesh, self.pspec(spec, len(shape)))))
        return out

    def outputs(self, arrays) -> list:
        out = []
        for o, a in zip(self.outs, arrays):
            if o.sharding is None:
                out.append(Tensor(np.asarray(a).reshape(o.shape), None, o.shape, o.dtype))
                continue
            shape = grid(o.sharding).shape + a.shape[len(self.atoms):]
            out.append(Tensor(a if a.shape == shape else a.reshape(shape), o.sharding, o.shape, o.dtype))
        return out

    def jitted(self):
        import jax
        in_specs = tuple([self.pspec(t.sharding, t.ndim) for t in self.twins] +
                         [self.pspec(spec, len(v._shape)) for v, spec in self.consts])
        out_specs = tuple(self.pspec(o.sharding, o.ndim) for o in self.outs)
        fn = jax.shard_map(lambda *arrays: run_body(self, arrays), mesh=self.jmesh, in_specs=in_specs,
                           out_specs=out_specs, check_vma=False)
        return jax.jit(fn)


def _block(spec: Any, shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(shape) if spec is None or not isinstance(spec, ShardingSpec) else chunks(spec, tuple(shape))


def _out_key(o: Tensor, rw: Rewritten) -> Key:
    return (o._serial, layout(o._spec))


def run_body(prog: CompiledProgram, arrays: tuple) -> tuple:
    """The function every device runs: the instructions, in order, on its blocks."""
    dev = JaxLocalBackend(prog.mesh, prog.atoms, prog.names)
    xp = dev.xp
    G = len(prog.atoms)
    env: dict = {}

    def block_of(a, v, spec):  # a block with no elements holds nothing: not read (XLA would fold it, and an
        b = a.reshape(a.shape[G:])  # unread manual-computation input fails)
        return xp.zeros(b.shape, b.dtype) if 0 in a.shape else b

    for k, t, a in zip(prog.input_keys, prog.twins, arrays):
        env[k] = block_of(a, t, t._spec)
    for k, (v, spec), a in zip(prog.rw.consts, prog.consts, arrays[len(prog.twins):]):
        env[k] = block_of(a, v, spec)
    for ins in prog.rw.instrs:
        got = _LOWER[ins.kind](ins, [None if r is None else env[r] for r in ins.reads], dev)
        if ins.kind == "bucket":
            for k, x in zip((ins.writes,) + ins.more, got):
                env[k] = x
        else:
            env[ins.writes] = got
    return tuple(env[k].reshape((1,) * G + tuple(env[k].shape)) for k in prog.out_keys)


def _lower_view(ins, blocks, dev):
    s = ins.step
    return blocks[0].reshape(_block(s.out_spec, s.out_shape) if isinstance(s.out_spec, ShardingSpec) else s.out_shape)


def _lower_manual(ins, blocks, dev):
    s = ins.step
    if hasattr(s.op, "lower"):
        return s.op.lower(blocks[0] if blocks else None, dev)
    return interpret.host(ins, blocks, dev)


#: the shared interpreter's jobs (``interpret``), and the kinds only a device's block has
_LOWER = {**interpret.JOBS, "view": _lower_view, "manual": _lower_manual}


_DEVICE_COPIES: dict[int, tuple] = {}  # id of numpy blocks -> (weak reference to them, jax sharding, jax array)


def _device_copy(data: Any, make: Callable[[], Any], target: Any) -> Any:
    """``make()`` (a global array of ``data``) on its devices as ``target``, reusing the copy made for the same
    read-only blocks before (they cannot change: tensors are immutable); the copy is dropped with them."""
    import jax
    key = id(data)
    hit = _DEVICE_COPIES.get(key)
    if hit is not None and hit[0]() is data and (hit[1] is target or hit[1] == target):
        return hit[2]
    if isinstance(data, np.ndarray) and not data.flags.writeable:
        # a private host copy: jax's CPU client may alias an aligned numpy buffer, and a cached device array
        # that holds the tensor's own blocks would keep them alive for ever (the weak reference never fires)
        arr = jax.device_put(np.array(make()), target)
        _DEVICE_COPIES[key] = (weakref.ref(data, partial(_forget, key=key)), target, arr)
        return arr
    return jax.device_put(make(), target)


def _forget(ref: Any, key: int, copies: dict = _DEVICE_COPIES) -> None:
    """Drop the device copy of blocks that are gone (only theirs: a later value may reuse the id; the table is
    bound here, so the callbacks that run at interpreter exit, after module globals are cleared, still find it)."""
    if copies.get(key, (None,))[0] is ref:
        del copies[key]

