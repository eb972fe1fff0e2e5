"""Compare nabla's communication with XLA's SPMD partitioner on the same sharded program.

A *case* is one program written twice, once with nabla ops and once with ``jax.numpy``, with the
same inputs and the same input shardings. nabla runs it eagerly under ``nb.strategy("aggressive")``
and logs its simulated collectives; jax compiles it with ``jax.jit(..., in_shardings, out_shardings)``
where the output sharding is the layout nabla's result ended in, so both programs start and end in
the same layout and any difference in bytes is a difference in how the middle was partitioned.

XLA's collectives are read from the compiled (post-SPMD-partitioning, per-device) HLO text rather
than from jax's own accounting because that text is what the partitioner actually emitted: every
shape in it is already a per-device block, so the bytes each device sends follow from the operand
shapes and the group size with the ring formulas nabla uses (``nabla/reshard/``):

=====================  ==========================
kind                   bytes sent per device
=====================  ==========================
all-gather             (k-1) * B     (B = the input block)
reduce-scatter         (k-1) * B // k
all-to-all             (k-1) * B // k
all-reduce             2 * (k-1) * B // k
collective-permute     B (0 if every device sends to itself)
=====================  ==========================

with ``B`` the bytes of all operands of the instruction (a combined or tuple collective counts
all of them) and ``k`` the replica-group size.

jax must see at least as many devices as the mesh has; on CPU that means
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` before jax is imported (``tests/conftest.py``
sets it; importing this module adds it when jax has not started yet).
"""

from __future__ import annotations

import math
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

if "jax" not in sys.modules and "xla_force_host_platform_device_count" not in os.environ.get(
        "XLA_FLAGS", ""):  # jax reads XLA_FLAGS once, when its CPU client starts
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

# -------------------------------------------------------------------------------------------------
# HLO text parsing
# -------------------------------------------------------------------------------------------------

_ITEMSIZE = {"pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4, "s64": 8,
             "u64": 8, "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16, "token": 0}

# HLO opcode -> nabla kind. Async pairs: the -start carries the operands and is counted, the -done
# only hands the result back and is skipped (so each collective counts once).
_OPCODES = {"all-gather": "all_gather", "all-gather-start": "all_gather",
            "all-reduce": "all_reduce", "all-reduce-start": "all_reduce",
            "reduce-scatter": "reduce_scatter", "all-to-all": "all_to_all", "ragged-all-to-all": "all_to_all",
            "collective-permute": "collective_permute", "collective-permute-start": "collective_permute"}
_SKIPPED = {"all-gather-done", "all-reduce-done", "collective-permute-done"}

_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([\d,]*)\]")
_HEADER = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_COMPUTATION = re.compile(r"^\s*(ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*\))?\s*->.*\{\s*$")


def _balanced(s: str, i: int) -> int:
    """Index just past the bracket group opening at ``s[i]`` (one of ``({[``)."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    stack = []
    for j in range(i, len(s)):
        c = s[j]
        if c in pairs:
            stack.append(pairs[c])
        elif stack and c == stack[-1]:
            stack.pop()
            if not stack:
                return j + 1
    raise ValueError(f"unbalanced brackets from {s[i:i + 80]!r}")


def _split_top(s: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    out, depth, cur = [], 0, []
    for c in s:
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        if c == "," and depth == 0:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(c)
    if "".join(cur).strip():
        out.append("".join(cur))
    return [x.strip() for x in out]


def shape_bytes(type_str: str) -> int:
    """Bytes of an HLO type, summed over the leaves of a tuple (``(f32[1,4]{1,0}, f32[4]{0})``)."""
    type_str = re.sub(r"/\*.*?\*/", "", type_str)
    total = 0
    for dtype, dims in _ARRAY.findall(type_str):
        if dtype.startswith("f8"):  # f8e4m3fn, f8e5m2, ...
            dtype = "u8"
        if dtype not in _ITEMSIZE:
            raise ValueError(f"unknown HLO element type {dtype!r} in {type_str!r}")
        total += _ITEMSIZE[dtype] * math.prod(int(d) for d in dims.split(",") if d)
    return total


@dataclass(frozen=True)
class Instruction:
    """One HLO instruction, as much of it as the byte count needs."""

    name: str
    type: str          # result type text
    opcode: str
    operands: tuple[str, ...]  # operand instruction names
    attrs: str         # everything after the operand list
    computation: str
    line: str


def parse_instructions(hlo: str) -> list[Instruction]:
    """Every instruction of every computation in an HLO module's text."""
    out, comp = [], ""
    for line in hlo.splitlines():
        m = _COMPUTATION.match(line)
        if m and "=" not in line.split("(")[0]:
            comp = m.group(2)
            continue
        m = _HEADER.match(line)
        if not m or line.lstrip().startswith(("HloModule", "//")):
            continue
        rest = line[m.end():]
        if rest.startswith("("):
            end = _balanced(rest, 0)
        else:
            t = re.match(r"[a-z][a-z0-9]*\[[^\]]*\](\{[^}]*\})?|[a-z][a-z0-9]*\b", rest)
            if not t:
                continue
            end = t.end()
        type_str, rest = rest[:end], rest[end:].lstrip()
        op = re.match(r"([\w\-]+)\(", rest)
        if not op:
            continue
        close = _balanced(rest, op.end() - 1)
        operands = tuple(re.findall(r"%([\w.\-]+)\s*$", a)[0] if re.search(r"%([\w.\-]+)\s*$", a) else a
                         for a in _split_top(rest[op.end():close - 1]))
        out.append(Instruction(m.group(1), type_str, op.group(1), operands, rest[close:], comp, line.strip()))
    return out


def _attr(attrs: str, key: str) -> str | None:
    """The raw text of ``key=...`` in an attribute list (a bracketed value is taken whole)."""
    m = re.search(r"(?:^|[\s,])" + re.escape(key) + r"=", attrs)
    if not m:
        return None
    i = m.end()
    if attrs[i] in "{[(":
        return attrs[i:_balanced(attrs, i)]
    j = i
    while j < len(attrs) and attrs[j] not in ", ":
        j += 1
    return attrs[i:j]


def _iota(dims: Sequence[int], reshape: Sequence[int], perm: Sequence[int] | None) -> np.ndarray:
    """XLA's iota tile assignment ``[dims]<=[reshape]T(perm)``: iota over ``reshape``, transposed, reshaped."""
    a = np.arange(math.prod(reshape)).reshape(reshape)
    if perm is not None:
        a = a.transpose(perm)
    return a.reshape(dims)


def _ints(s: str) -> list[int]:
    return [int(x) for x in re.findall(r"-?\d+", s)]


def _mesh_axes_groups(text: str) -> list[list[int]]:
    """Groups of XLA's mesh-axes replica-group form (what jax 0.10 / XLA print by default)::

        mesh['axis_0'=4,'axis_1'=2], device_ids=([2,2,2]T(0,2,1)) {'axis_0':(2)2}

    a mesh (axis names and sizes, device ids in iota or list form, iota 0..n-1 when absent), then the
    axes that form one group, each a whole axis or a Shardy sub-axis ``name:(pre_size)size``. Like
    XLA's ``MeshAxesReplicaGroupList::flattened_replica_groups``: split every mesh axis into the
    pieces the group axes name, move the group's pieces last (in the listed order), cut into rows.
    """
    m = re.match(r"mesh\[(.*?)\](?:,\s*device_ids=\((.*?)\))?\s*\{(.*)\}\s*$", text.strip())
    if not m:
        raise ValueError(f"unrecognised mesh replica groups {text!r}")
    axes = [(n, int(s)) for n, s in re.findall(r"'?([\w.\-]+)'?=(\d+)", m.group(1))]
    names, sizes = [n for n, _ in axes], [s for _, s in axes]
    n = math.prod(sizes)
    ids = m.group(2)
    if ids is None:
        devices = np.arange(n).reshape(sizes)
    else:
        it = re.fullmatch(r"\s*\[([\d,]+)\](?:T\(([\d,]+)\))?\s*", ids)
        if it:
            devices = _iota(sizes, _ints(it.group(1)), _ints(it.group(2)) if it.group(2) else None)
        else:  # an explicit list (not seen from jax 0.10.2: partition-level meshes come out as iotas)
            flat = _ints(ids)
            if not re.fullmatch(r"[\d,\s]+", ids) or sorted(flat) != list(range(n)):
                raise ValueError(f"unrecognised device_ids {ids!r} in {text!r}")
            devices = np.array(flat).reshape(sizes)
    refs = []  # (axis index, pre_size, size)
    for ref in _split_top(m.group(3)):
        r = re.fullmatch(r"'?([\w.\-]+)'?(?::\((\d+)\)(\d+))?", ref.strip())
        if not r:
            raise ValueError(f"unrecognised axis {ref!r} in {text!r}")
        a = names.index(r.group(1))
        refs.append((a, int(r.group(2)), int(r.group(3))) if r.group(2) else (a, 1, sizes[a]))
    # Split each mesh axis (major to minor) into pieces at every sub-axis boundary.
    pieces, where = [], {}  # where[(axis, pre, size)] -> piece index
    for a, size in enumerate(sizes):
        cuts = sorted({1, size} | {p for b, p, _ in refs if b == a} | {p * s for b, p, s in refs if b == a})
        # XLA's pre-size counts the *major* pieces (reshape [pre, size, rest]): the piece with
        # pre-size p spans [p, next cut), and increasing pre-size runs major to minor.
        for lo, hi in zip(cuts, cuts[1:]):
            where[(a, lo)] = len(pieces)
            pieces.append(hi // lo)
    grouped = []
    for a, p, s in refs:  # a sub-axis may span several pieces, major first
        acc = p
        while acc < p * s:
            i = where[(a, acc)]
            grouped.append(i)
            acc *= pieces[i]
    rest = [i for i in range(len(pieces)) if i not in grouped]
    arr = devices.reshape(pieces).transpose(rest + grouped)
    k = math.prod(pieces[i] for i in grouped)
    return arr.reshape(-1, k).tolist()


def replica_groups(attrs: str, num_partitions: int) -> list[list[int]]:
    """The device groups of a collective, whichever way XLA printed them.

    Forms: explicit ``{{0,1},{2,3}}``; empty ``{}`` (one group of every partition); iota
    ``[G,k]<=[dims]T(perm)``; and the mesh-axes form (see ``_mesh_axes_groups``).
    """
    raw = _attr(attrs, "replica_groups")
    if raw is None:
        return [list(range(num_partitions))]
    if raw.startswith("mesh"):
        # the mesh form runs past the first comma: take the rest up to the next attribute
        m = re.search(r"replica_groups=(mesh\[.*?\](?:,\s*device_ids=\(.*?\))?\s*\{[^}]*\})", attrs)
        return _mesh_axes_groups(m.group(1))
    if raw.startswith("{"):
        groups = [_ints(g) for g in re.findall(r"\{([\d,\s]*)\}", raw[1:-1])]
        return groups if groups and groups[0] else [list(range(num_partitions))]
    m = re.match(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs[attrs.index("replica_groups="):])
    if m:
        dims = _ints(m.group(1))
        return _iota(dims, _ints(m.group(2)), _ints(m.group(3)) if m.group(3) else None).reshape(
            -1, dims[-1]).tolist()
    raise ValueError(f"unrecognised replica_groups in {attrs!r}")


@dataclass(frozen=True)
class XlaCollective:
    """One collective of the partitioned HLO: kind (nabla's spelling), group size, bytes per device.

    ``senders`` are the partitions that send ``bytes``: every member of a group for the group
    collectives, and for a collective-permute only the sources of pairs whose target is another
    device (so ``group`` is the number of those senders).
    """

    kind: str
    group: int
    bytes: int
    senders: frozenset = frozenset()
    groups: tuple = ()     # device groups (source-target pairs for a collective-permute)
    hlo: str = ""          # the instruction, for failure messages
    emitted: str = ""      # the kind in the HLO when it differs (see ``collectives``)

    def __repr__(self) -> str:
        star = "*" if self.emitted and self.emitted != self.kind else ""
        return f"{self.kind}{star}(k={self.group}; {self.bytes} B/device)"


def bytes_per_device(colls: Sequence[XlaCollective]) -> int:
    """The most bytes any one device sends over the whole program.

    This is the sum of the per-collective figures when every device takes part in every collective;
    it is less when a collective-permute leaves some devices idle and another one others (XLA cuts
    a sliced layout into several partial permutes), and it is never more, so comparing nabla's sum
    against it never flatters nabla.
    """
    devices = set().union(*(c.senders for c in colls)) if colls else set()
    return max((sum(c.bytes for c in colls if d in c.senders) for d in devices), default=0)


def _only_sliced(ar: Instruction, insts: Sequence[Instruction], k: int) -> bool:
    """Is every use of this all-reduce's result a dynamic-slice down to 1/k of it (directly, through
    bitcasts, or inside a fusion)? That is a reduce-scatter spelled as all-reduce + dynamic-slice."""
    by_comp: dict[str, list[Instruction]] = {}
    for i in insts:
        by_comp.setdefault(i.computation, []).append(i)
    whole = shape_bytes(ar.type)

    def sliced(name: str, comp: str) -> bool:
        users = [u for u in by_comp.get(comp, []) if name in u.operands]
        if not users:
            return False
        for u in users:
            if u.opcode == "dynamic-slice" and u.operands[0] == name:
                if shape_bytes(u.type) * k != whole:
                    return False
            elif u.opcode in ("bitcast", "reshape", "copy"):
                if not sliced(u.name, comp):
                    return False
            elif u.opcode == "fusion" and u.operands.count(name) == 1:
                called = (_attr(u.attrs, "calls") or "").lstrip("%")
                j = str(u.operands.index(name))
                params = [p.name for p in by_comp.get(called, []) if p.opcode == "parameter" and p.operands == (j,)]
                if len(params) != 1 or not sliced(params[0], called):
                    return False
            else:
                return False
        return True

    return len(ar.operands) == 1 and sliced(ar.name, ar.computation)


def collectives(hlo: str, reduce_scatter_creator: bool = True) -> list[XlaCollective]:
    """Every collective in a compiled, SPMD-partitioned HLO module, with nabla's per-device byte count.

    ``reduce_scatter_creator``: XLA's CPU pipeline leaves a reduce-scatter as the partitioner wrote
    it, an all-reduce whose result each device then dynamic-slices to its 1/k; GPU and TPU run
    ``ReduceScatterCreator`` and send a reduce-scatter (half the bytes). Counted as the
    reduce-scatter by default (``emitted`` keeps "all-reduce"), so nabla is held to what XLA sends
    where it is at its best, not to an artefact of the CPU backend.

    A collective inside a loop or conditional body would run more than once, so a module with
    collectives outside straight-line code (ENTRY, fusions, async wrappers) is refused rather than
    undercounted.
    """
    insts = parse_instructions(hlo)
    types = {i.name: i.type for i in insts}
    m = re.search(r"num_partitions=(\d+)", hlo)
    num_partitions = int(m.group(1)) if m else 1
    looped = set()  # bodies of loops and branches of conditionals
    for i in insts:
        if i.opcode in ("while", "conditional"):
            for key in ("body", "condition", "branch_computations", "true_computation", "false_computation"):
                looped |= set(re.findall(r"%?([\w.\-]+)", _attr(i.attrs, key) or ""))
    out = []
    for i in insts:
        if i.opcode in _SKIPPED:
            continue
        kind = _OPCODES.get(i.opcode)
        if kind is None:
            continue
        if i.computation in looped:
            raise NotImplementedError(f"collective inside a loop or conditional body: {i.line}")
        B = sum(shape_bytes(types[o]) for o in i.operands if o in types)
        if B == 0:
            raise ValueError(f"could not resolve the operand shapes of {i.line}")
        if kind == "collective_permute":
            pairs = [tuple(p) for p in (_ints(g) for g in re.findall(r"\{(\d+,\d+)\}", _attr(i.attrs, "source_target_pairs") or ""))]
            if "collective-permute-start" == i.opcode:  # -start operands: (input, output buffers...) -> input only
                B = shape_bytes(types[i.operands[0]])
            senders = frozenset(a for a, b in pairs if a != b)
            out.append(XlaCollective(kind, len(senders), B if senders else 0, senders, tuple(pairs), i.line))
            continue
        groups = replica_groups(i.attrs, num_partitions)
        k = len(groups[0])
        if any(len(g) != k for g in groups):
            raise ValueError(f"groups of different sizes in {i.line}")
        emitted = kind
        if kind == "all_reduce" and reduce_scatter_creator and k > 1 and _only_sliced(i, insts, k):
            kind = "reduce_scatter"
        nbytes = {"all_gather": (k - 1) * B, "reduce_scatter": (k - 1) * B // k, "all_to_all": (k - 1) * B // k,
                  "all_reduce": 2 * (k - 1) * B // k}[kind]
        out.append(XlaCollective(kind, k, nbytes, frozenset(d for g in groups for d in g), tuple(map(tuple, groups)),
                                 i.line, emitted))
    return out


# -------------------------------------------------------------------------------------------------
# Running both sides
# -------------------------------------------------------------------------------------------------

def jax_mesh(mesh: Any, explicit: bool = False):
    """The jax ``Mesh`` of a nabla ``DeviceMesh``: same axis names and sizes, device ``d`` is ``jax.devices()[d]``
    (``explicit``: every axis of type ``Explicit``, as jax's unreduced outputs need)."""
    import jax
    from jax.sharding import AxisType, Mesh

    devices = jax.devices("cpu")
    if max(mesh.devices) >= len(devices):
        raise RuntimeError(f"jax has {len(devices)} CPU devices, the mesh uses ids up to {max(mesh.devices)}: start "
                           f"python with XLA_FLAGS=--xla_force_host_platform_device_count={max(mesh.devices) + 1} "
                           f"(set before jax is imported)")
    types = {"axis_types": (AxisType.Explicit,) * len(mesh.shape)} if explicit else {}
    return Mesh(np.array([devices[d] for d in mesh.devices], dtype=object).reshape(mesh.shape), mesh.axis_names,
                **types)


def partition_spec(spec: Any, unreduced: bool = False):
    """A nabla ``ShardingSpec`` as a closed jax ``PartitionSpec``: open dims become replicated, so
    XLA is held to exactly the layout nabla produced (an UNCONSTRAINED out_sharding would let it pick).
    With ``unreduced``, partial axes become jax's ``unreduced`` axes (which need an Explicit mesh)."""
    from jax.sharding import PartitionSpec

    if spec.partial_axes and not unreduced:
        raise ValueError(f"{spec!r} holds partial sums; reduce it first (with_sharding) so jax can name it")
    entries = [None if not d.axes else d.axes[0] if len(d.axes) == 1 else tuple(d.axes) for d in spec.dim_specs]
    if spec.partial_axes:
        return PartitionSpec(*entries, unreduced=frozenset(spec.partial_axes))
    return PartitionSpec(*entries)


def compile_xla(fn: Callable, args: Sequence[np.ndarray], in_specs: Sequence[Any], out_specs: Any, jmesh: Any):
    """Compile ``fn`` with these shardings; returns (compiled HLO text, output values as numpy).

    ``out_specs`` is one PartitionSpec, or a tuple of them when ``fn`` returns a tuple.
    """
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    ins = tuple(NamedSharding(jmesh, s) for s in in_specs)
    outs = (NamedSharding(jmesh, out_specs) if isinstance(out_specs, PartitionSpec)
            else tuple(NamedSharding(jmesh, s) for s in out_specs))
    placed = [jax.device_put(a, s) for a, s in zip(args, ins)]
    explicit = any(t == jax.sharding.AxisType.Explicit for t in getattr(jmesh, "axis_types", ()))
    with (jax.set_mesh(jmesh) if explicit else _nothing()):
        compiled = jax.jit(fn, in_shardings=ins, out_shardings=outs).lower(*placed).compile()
        value = compiled(*placed)
        value = list(value) if isinstance(value, (tuple, list)) else [value]
        # an unreduced result is summed for reading, outside the compiled program whose collectives are counted
        value = [jax.jit(lambda v, spec=PartitionSpec(*v.sharding.spec.partitions): jax.reshard(v, spec))(v)
                 if getattr(v.sharding.spec, "unreduced", None) else v for v in value]
    return compiled.as_text(), [np.asarray(v) for v in value]


def _nothing():
    import contextlib
    return contextlib.nullcontext()


def run_xla(fn: Callable, args: Sequence[np.ndarray], in_specs: Sequence[Any], out_specs: Any, mesh: Any,
            explicit: bool = False):
    """XLA's collectives (kind, group, bytes per device) for ``fn``, its output values and its HLO."""
    hlo, values = compile_xla(fn, args, in_specs, out_specs, jax_mesh(mesh, explicit))
    return collectives(hlo), values, hlo


@dataclass
class Case:
    """One program for both frameworks.

    ``specs`` are nabla dim-spec lists, one per input (``None`` for a replicated input);
    ``nabla_fn`` takes the sharded nabla tensors (and the mesh as keyword ``mesh``) and returns a
    tensor or a tuple of tensors; ``jax_fn`` takes the jax arrays and computes the same math with
    ``jax.numpy``. A partial (pending-sum) result is compared with jax's ``unreduced`` output: such a
    case runs on an Explicit mesh (jax's rule), so ``jax_fn`` names the unreduced axes itself
    (``jnp.matmul(a, b, out_sharding=P(..., unreduced={"tp"}))``).
    ``xfail`` says why nabla sends more than XLA on this case, when it does; ``values_xfail`` why
    nabla's values differ from jax's (a known nabla bug), when they do.
    """

    name: str
    mesh_shape: tuple
    axis_names: tuple
    inputs: tuple
    specs: tuple
    nabla_fn: Callable
    jax_fn: Callable
    rtol: float = 1e-5
    atol: float = 1e-5
    xfail: str | None = None
    values_xfail: str | None = None


@dataclass
class Result:
    case: Case
    nabla_events: list
    xla: list
    nabla_values: list
    xla_values: list
    out_specs: list
    hlo: str = field(repr=False, default="")

    @property
    def nabla_bytes(self) -> int:
        return sum(e.bytes for e in self.nabla_events)

    @property
    def xla_bytes(self) -> int:
        return bytes_per_device(self.xla)

    @property
    def values_verdict(self) -> str:
        """"yes", or what differs between nabla's and jax's results."""
        if len(self.nabla_values) != len(self.xla_values):
            return f"NO: {len(self.nabla_values)} vs {len(self.xla_values)} results"
        for a, b in zip(self.nabla_values, self.xla_values):
            if a.shape != b.shape:
                same = a.size == b.size and np.allclose(a.reshape(b.shape), b, rtol=self.case.rtol, atol=self.case.atol)
                return f"NO: shape {a.shape} vs {b.shape}" + (" (values equal)" if same else "")
            if not np.allclose(a, b, rtol=self.case.rtol, atol=self.case.atol):
                return f"NO: max |diff| {np.max(np.abs(a - b)):.3g}"
        return "yes"

    @property
    def values_equal(self) -> bool:
        return self.values_verdict == "yes"


def run_case(case: Case) -> Result:
    """Run a case in nabla (aggressive strategy, comm log) and in XLA (same in/out shardings)."""
    import nabla as nb
    from jax.sharding import PartitionSpec

    mesh = nb.DeviceMesh("m", case.mesh_shape, case.axis_names)
    tensors = [nb.tensor(x) if s is None else nb.tensor(x).shard(mesh, s) for x, s in zip(case.inputs, case.specs)]
    with nb.strategy("aggressive"), nb.comm_log() as log:
        out = case.nabla_fn(*tensors, mesh=mesh)
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    for o in outs:
        if o.sharding is None:
            raise ValueError(f"{case.name}: nabla returned an unsharded tensor")
    in_specs = [PartitionSpec(*([None] * x.ndim)) if t.sharding is None else partition_spec(t.sharding)
                for t, x in zip(tensors, case.inputs)]
    explicit = any(o.sharding.partial_axes for o in outs)
    out_specs = [partition_spec(o.sharding, unreduced=explicit) for o in outs]
    xla, values, hlo = run_xla(case.jax_fn, case.inputs, in_specs,
                               tuple(out_specs) if isinstance(out, (tuple, list)) else out_specs[0], mesh, explicit)
    return Result(case, list(log.events), xla, [o.numpy() for o in outs], values, out_specs, hlo)


# -------------------------------------------------------------------------------------------------
# Reporting
# -------------------------------------------------------------------------------------------------

def _spell(kinds_bytes: Sequence[tuple[str, int, int]]) -> str:
    if not kinds_bytes:
        return "-"
    return ", ".join(f"{k}/{g}:{b}" for k, g, b in kinds_bytes)


def format_row(r: Result) -> tuple[str, ...]:
    nab = [(e.kind, e.group, e.bytes) for e in r.nabla_events]
    xla = [(c.kind + ("*" if c.emitted and c.emitted != c.kind else ""), c.group, c.bytes) for c in r.xla]
    verdict = "ok" if r.nabla_bytes <= r.xla_bytes else "MORE"
    return (r.case.name, _spell(nab), str(r.nabla_bytes), _spell(xla), str(r.xla_bytes), verdict,
            r.values_verdict)


LEGEND = ("kind/group:bytes = one collective, its group size and bytes sent per device (ring formulas); for a "
          "collective_permute the group is the number of devices that send. XLA B is the most any one device sends "
          "in total. reduce_scatter* = emitted by XLA's CPU backend as all-reduce + dynamic-slice, counted as the "
          "reduce-scatter GPU/TPU would send.")

HEADER = ("case", "nabla collectives (kind/group:bytes)", "nabla B", "XLA collectives (kind/group:bytes)", "XLA B",
          "nabla<=XLA", "values equal")


def format_table(results: Sequence[Result], markdown: bool = False) -> str:
    """One line per case: both frameworks' collectives and total bytes per device."""
    rows = [HEADER] + [format_row(r) for r in results]
    if markdown:
        lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows[1:]]
        return "\n".join(lines)
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)
