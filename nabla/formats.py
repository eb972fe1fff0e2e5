"""Text and JAX formats of a ShardingSpec: HLO/MHLO sharding strings (as XLA defines them) with XLA's semantics
(tile dims map to tensor dims in order; ``last_tile_dim_replicate`` lists each tile's replicas), and
JAX ``PartitionSpec`` (jax is imported only when one is asked for)."""

from __future__ import annotations

import re
import sys
import warnings
from math import prod
from typing import Any

import numpy as np

from .errors import ShardingError
from .layout import dim_position
from .args import MAX_RANK, bounded_tuple, short_repr
from .mesh import MAX_DEVICE_ID, AxisRef, DeviceMesh, merge_adjacent
from .spec import DimSpec, ShardingSpec, check_rank_arg, is_unconstrained


# ---- HLO sharding strings ------------------------------------------------------------------------


def to_mhlo(spec: ShardingSpec) -> str:
    if spec.partial_axes:
        raise ShardingError(f"to_mhlo: spec {spec!r} has partial axes {list(spec.partial_axes)}; "
                            f"HLO sharding strings cannot express unreduced sums (reduce them first)")
    tiles = [spec.num_shards(i) for i in range(spec.rank)]
    if prod(tiles) == 1:
        return "{replicated}"
    mesh = spec.mesh
    rep = mesh.size // prod(tiles)
    cells: dict[tuple[int, ...], list[int]] = {}
    for d in mesh.devices:  # mesh order, so replicas of a tile are listed in mesh order
        c = mesh.coords(d)
        cells.setdefault(tuple(dim_position(refs, mesh, c) for refs in spec.dim_refs), []).append(d)
    arr = np.empty(tiles + [rep], dtype=np.int64)
    for tile, devs in cells.items():
        arr[tile] = devs
    dims = tiles + ([rep] if rep > 1 else [])
    ids = ",".join(str(int(d)) for d in arr.reshape(-1))
    return "{devices=[" + ",".join(map(str, dims)) + "]" + ids + (" last_tile_dim_replicate" if rep > 1 else "") + "}"


_TOKEN = re.compile(r"\s*(?:(?P<num>[0-9]+)|(?P<word>[A-Za-z_]+)|(?P<sym><=|[{}\[\],=()T]))")
_MORE_IDS = re.compile(r"[0-9,\s]*")  # a plain character run: no regex stack per number
#: Digits past this many cannot be a device id, a tile count or a dim of any mesh nabla builds.
_MAX_DIGITS = 19


class _Parser:
    """A tiny recursive-descent reader that reports the character position of any fault.

    Every number it reads is bounded by the caller (a tile count by the mesh size, a device id by
    the mesh's ids) before anything is allocated, so no string can ask for unbounded memory or time.
    """

    def __init__(self, text: str) -> None:
        self.text, self.pos = text, 0

    def fail(self, what: str) -> ShardingError:
        before, after = self.text[max(0, self.pos - 60):self.pos], self.text[self.pos:self.pos + 60]
        shown = ("..." if self.pos > 60 else "") + before + " <<here>> " + after + \
            ("..." if len(self.text) > self.pos + 60 else "")
        return ShardingError(f"from_mhlo: malformed sharding at position {self.pos}: {what}; in {shown!r}")

    def peek(self) -> str | None:
        m = _TOKEN.match(self.text, self.pos)
        return m.group(m.lastgroup) if m and m.lastgroup else None

    def take(self, expected: str | None = None, kind: str | None = None) -> str:
        m = _TOKEN.match(self.text, self.pos)
        if not m or not m.lastgroup:
            rest = self.text[self.pos:].strip()
            raise self.fail(f"expected {expected or kind or 'a token'}, found {rest[:1]!r}" if rest
                            else f"expected {expected or kind or 'a token'}, found the end")
        tok = m.group(m.lastgroup)
        if (expected is not None and tok != expected) or (kind is not None and m.lastgroup != kind):
            while self.pos < len(self.text) and self.text[self.pos].isspace():
                self.pos += 1
            raise self.fail(f"expected {expected or kind}, found {short_repr(tok, 40)}")
        self.pos = m.end()
        return tok

    def num(self, what: str, hi: int, lo: int = 0) -> int:
        """One number in ``[lo, hi]``; refused by its digit count before ``int()`` when it is huge."""
        start = self.pos
        tok = self.take(kind="num")
        digits = tok.lstrip("0") or "0"
        if len(digits) > _MAX_DIGITS or not lo <= int(digits) <= hi:
            self.pos = start
            shown = digits if len(digits) <= 24 else f"{digits[:12]}...({len(digits)} digits)"
            raise self.fail(f"{what} {shown} is out of range [{lo}, {hi}]")
        return int(digits)

    def ints(self, close: str, what: str, hi: int, lo: int, most: int) -> list[int]:
        """A comma list of at most ``most`` numbers in ``[lo, hi]``, then ``close``."""
        out = [self.num(what, hi, lo)]
        while self.peek() == ",":
            self.take(",")
            if len(out) == most:
                raise self.fail(f"more than {most} {what}s")
            out.append(self.num(what, hi, lo))
        self.take(close)
        return out

    def end(self) -> None:
        rest = self.text[self.pos:].strip()
        if rest:
            raise self.fail(f"unexpected text {short_repr(rest, 40)} after the closing brace")


def from_mhlo(mesh: DeviceMesh, text: str, rank: int | None = None) -> ShardingSpec:
    """The spec of an HLO sharding string on ``mesh`` (``from_mhlo(text, mesh, rank)`` is the deprecated order).

    Sizes are checked against the mesh as they are read: tile counts multiply to at most the mesh
    size, device ids are the mesh's, an iota ``<=[...]`` reshapes exactly the mesh's device count.
    ``{maximal device=d}`` (one device holds the value) has no nabla counterpart except on a
    one-device mesh, where it is the replicated spec.
    """
    mesh, text = _mhlo_args(mesh, text, "from_mhlo")
    if not isinstance(text, str):
        raise ShardingError(f"from_mhlo: text must be a str, got {type(text).__name__} {short_repr(text)}")
    if rank is not None:
        rank = check_rank_arg(rank, "from_mhlo", may_be_none=True)
    p = _Parser(text)
    p.take("{")
    head = p.take(kind="word")
    if head == "replicated":
        p.take("}")
        p.end()
        if rank is None:
            raise ShardingError("from_mhlo: '{replicated}' carries no rank; pass rank=")
        return ShardingSpec.replicated(mesh, rank)
    if head == "maximal":
        p.take("device")
        p.take("=")
        dev = p.num("device id", MAX_DEVICE_ID)
        p.take("}")
        p.end()
        if dev not in mesh.devices:
            raise ShardingError(f"from_mhlo: maximal device={dev} is not in mesh @{mesh.name} "
                                f"(devices {short_repr(list(mesh.devices))})")
        if mesh.size != 1:
            raise ShardingError(
                f"from_mhlo: {text.strip()!r} puts the whole value on device {dev} alone, but nabla has no "
                f"single-device placement: a tensor lives on every device of its mesh, and mesh @{mesh.name} "
                f"has {mesh.size}. Use '{{replicated}}' (every device holds the whole value), or a one-device "
                f"mesh DeviceMesh(name, (1,), (axis,), devices=[{dev}]), on which maximal device={dev} is "
                f"replicated")
        if rank is None:
            raise ShardingError("from_mhlo: '{maximal ...}' carries no rank; pass rank=")
        return ShardingSpec.replicated(mesh, rank)
    if head in ("manual", "unknown"):
        raise ShardingError(f"from_mhlo: {{{head}}} sharding has no nabla spec; nabla places every value "
                            f"itself (write per-device code with nb.shard_map)")
    if head != "devices":
        p.pos -= len(head)
        raise p.fail(f"expected 'replicated', 'maximal' or 'devices', found {short_repr(head, 40)}")
    p.take("=")
    p.take("[")
    n = mesh.size
    dims = p.ints("]", "tile count", hi=MAX_DEVICE_ID, lo=1, most=MAX_RANK + 1)
    total = prod(dims)  # at most MAX_RANK + 1 factors below 2**63: a small product, compared before any use
    if total != n:
        held = total if total <= MAX_DEVICE_ID else "more than 2**63"
        raise ShardingError(f"from_mhlo: tile dims {short_repr(dims)} hold {held} devices but mesh @{mesh.name} "
                            f"{list(mesh.shape)} has {n}")
    if p.peek() == "<=":  # XLA's iota form: <=[reshape dims] with an optional T(perm)
        p.take("<=")
        p.take("[")
        iota = p.ints("]", "iota dim", hi=MAX_DEVICE_ID, lo=1, most=MAX_RANK)
        if prod(iota) != n:
            held = prod(iota) if prod(iota) <= MAX_DEVICE_ID else "more than 2**63"
            raise ShardingError(f"from_mhlo: iota dims {short_repr(iota)} hold {held} devices but the tile dims "
                                f"{short_repr(dims)} (and mesh @{mesh.name}) hold {n}")
        ids = np.arange(n).reshape(iota)
        if p.peek() == "T":
            p.take("T")
            p.take("(")
            perm = p.ints(")", "transpose dim", hi=len(iota) - 1, lo=0, most=len(iota))
            if sorted(perm) != list(range(len(iota))):
                raise p.fail(f"T{tuple(perm)} is not a permutation of {len(iota)} dims")
            ids = ids.transpose(perm)
        ids = ids.reshape(-1).tolist()
        if sorted(mesh.devices) != list(range(n)):  # the iota form names devices 0..n-1
            raise ShardingError(f"from_mhlo: {short_repr(text.strip())} names devices 0..{n - 1}, which are not the "
                                f"devices of mesh @{mesh.name} {short_repr(list(mesh.devices))}")
    else:
        known = set(mesh.devices)
        ids = []
        listed = 0
        while True:
            at = p.pos
            if listed < n:
                d = p.num("device id", MAX_DEVICE_ID)
                if d not in known:
                    p.pos = at
                    raise p.fail(f"device {d} is not in mesh @{mesh.name}: the devices listed are not the "
                                 f"devices of mesh @{mesh.name} {short_repr(list(mesh.devices), 60)}")
                ids.append(d)
                listed += 1
            else:  # too many: the rest is only counted (no per-number work), for the message
                run = _MORE_IDS.match(p.text, p.pos).group(0)
                packed = "".join(run.split())
                if not packed or packed.startswith(",") or packed.endswith(",") or ",," in packed:
                    p.take(kind="num")  # raises: a comma with no number after it
                listed += 1 + packed.count(",")
                p.pos += len(run)
                break
            if p.peek() != ",":
                break
            p.take(",")
        if listed != n:
            raise ShardingError(f"from_mhlo: tile dims {short_repr(dims)} hold {n} devices but {listed} are listed in "
                                f"{short_repr(text.strip(), 120)}")
        if len(set(ids)) != n:
            from collections import Counter
            dup = sorted(d for d, k in Counter(ids).items() if k > 1)
            raise ShardingError(f"from_mhlo: device(s) {short_repr(dup)} are listed more than once in "
                                f"{short_repr(text.strip(), 120)}; each device of mesh @{mesh.name} appears once")
    replicate = False
    if p.peek() == "last_tile_dim_replicate":
        p.take("last_tile_dim_replicate")
        replicate = True
    p.take("}")
    p.end()
    return _from_tiles(dims, ids, replicate, mesh, rank, text)


def _from_tiles(dims: list[int], ids: list[int], replicate: bool, mesh: DeviceMesh, rank: int | None,
                text: str) -> ShardingSpec:
    # the caller has checked: prod(dims) == len(ids) == mesh.size, and ids are the mesh's devices, once each
    tiles = dims[:-1] if replicate else dims
    if rank is not None and rank != len(tiles):
        raise ShardingError(f"from_mhlo: {short_repr(text.strip(), 120)} tiles {len(tiles)} dims but rank={rank} was given")
    if len(tiles) > MAX_RANK:
        raise ShardingError(f"from_mhlo: {len(tiles)} tile dims; a spec has at most {MAX_RANK}")
    arr = np.array(ids).reshape(dims if replicate else dims + [1])
    dim_specs = []
    for i, t in enumerate(tiles):
        # Walk dim i from its origin; peel the minor-most sub-axis that moves one mesh axis evenly.
        seq = [mesh.coords(int(arr[(0,) * i + (j,) + (0,) * (len(tiles) - i)])) for j in range(t)]
        refs: list[AxisRef] = []
        while len(seq) > 1:
            step = [b - a for a, b in zip(seq[0], seq[1])]
            moved = [k for k, v in enumerate(step) if v]
            if len(moved) != 1 or step[moved[0]] < 0:
                raise _unexpressible(text, mesh, i)
            a, v = moved[0], step[moved[0]]
            n = mesh.shape[a]
            s = 1
            while s < len(seq) and seq[s][a] == seq[0][a] + s * v and \
                    all(seq[s][k] == seq[0][k] for k in range(len(step)) if k != a):
                s += 1
            while s > 1 and (len(seq) % s or n % (v * s)):
                s -= 1
            if s < 2:
                raise _unexpressible(text, mesh, i)
            refs.insert(0, AxisRef(mesh.axis_names[a], n // (v * s), s, n))
            seq = seq[::s]
        dim_specs.append(DimSpec(tuple(str(r) for r in merge_adjacent(refs))))
    try:
        spec = ShardingSpec(mesh, dim_specs)
    except ShardingError:
        raise _unexpressible(text, mesh, None) from None
    flat = arr.reshape(len(ids) // arr.shape[-1], arr.shape[-1]) if tiles else arr.reshape(1, -1)
    for tile_idx, row in zip(np.ndindex(*tiles), flat):
        for d in row:
            got = tuple(dim_position(refs, mesh, mesh.coords(int(d))) for refs in spec.dim_refs)
            if got != tile_idx:
                raise _unexpressible(text, mesh, None)
    return spec


def _unexpressible(text: str, mesh: DeviceMesh, dim: int | None) -> ShardingError:
    where = f" (tile dim {dim})" if dim is not None else ""
    return ShardingError(f"from_mhlo: the device order of {short_repr(text.strip(), 200)}{where} is not a tiling of mesh "
                         f"{mesh!r} by its axes or sub-axes")


# ---- JAX PartitionSpec ---------------------------------------------------------------------------


def to_partition_spec(spec: ShardingSpec) -> Any:
    """The JAX ``PartitionSpec`` of ``spec``: partial axes become ``unreduced`` (jax >= 0.7 has it; an
    older jax raises ``ShardingError``). Sub-axes have no PartitionSpec spelling; replicated axes and
    priorities are hints JAX has no field for and are dropped, and so is the openness of a dim that has axes."""
    from jax.sharding import PartitionSpec  # imported only here: `import nabla` never pulls in jax

    entries: list[Any] = []
    for i, (d, refs) in enumerate(zip(spec.dim_specs, spec.dim_refs)):
        for r in refs:
            if not r.is_full:
                raise ShardingError(f"to_partition_spec: dim {i} uses sub-axis {str(r)!r}; "
                                    f"a PartitionSpec names whole mesh axes only")
        if not d.axes:
            entries.append(PartitionSpec.UNCONSTRAINED if d.is_open else None)
        else:
            entries.append(d.axes[0] if len(d.axes) == 1 else tuple(d.axes))
    if spec.partial_axes:
        for r in spec.partial_refs:
            if not r.is_full:
                raise ShardingError(f"to_partition_spec: partial axis {str(r)!r} is a sub-axis; a PartitionSpec's "
                                    f"`unreduced` names whole mesh axes only")
        try:
            return PartitionSpec(*entries, unreduced=set(spec.partial_axes))
        except TypeError:
            import jax
            raise ShardingError(f"to_partition_spec: spec {spec!r} has partial axes {list(spec.partial_axes)}, which "
                                f"a PartitionSpec holds as `unreduced`; jax {jax.__version__} has no `unreduced` "
                                f"(it needs jax >= 0.7); reduce the partial axes first") from None
    return PartitionSpec(*entries)


def _jax_pspec() -> Any:
    """jax's ``PartitionSpec`` class if jax is already imported, else ``None``: a ``PartitionSpec`` (or its
    ``UNCONSTRAINED``) cannot exist before jax is imported, so nabla never imports jax to recognise one."""
    if sys.modules.get("jax") is None:  # not imported (or blocked: None)
        return None
    from jax.sharding import PartitionSpec
    return PartitionSpec


def from_partition_spec(mesh: DeviceMesh, pspec: Any) -> ShardingSpec:
    """The spec of a JAX ``PartitionSpec`` (or a plain tuple or list of its entries) on ``mesh``.

    Entries: ``None`` (replicated), an axis name, a tuple or list of axis names (major to minor) and
    ``PartitionSpec.UNCONSTRAINED`` (an open dim). ``unreduced`` axes become partial axes. Anything
    else (an int, bytes, a float, ``reduced`` axes) raises ``ShardingError``.
    """
    if not isinstance(mesh, DeviceMesh):
        raise ShardingError(f"from_partition_spec(mesh, pspec): mesh must be a DeviceMesh, got "
                            f"{type(mesh).__name__} {short_repr(mesh)}")
    unreduced: Any = ()
    P = _jax_pspec()
    if P is not None and isinstance(pspec, P):
        # jax >= 0.7 refuses to iterate a spec with unreduced axes: read .partitions
        entries = tuple(pspec.partitions) if hasattr(pspec, "partitions") else tuple(pspec)
        unreduced = getattr(pspec, "unreduced", None) or ()
        reduced = getattr(pspec, "reduced", None)
        if reduced:
            raise ShardingError(f"from_partition_spec: {short_repr(pspec)} has reduced axes {sorted(reduced)}; nabla has "
                                f"no `reduced` placement (a replicated value whose gradient is left unreduced)")
    elif isinstance(pspec, (tuple, list)):  # older jax's PartitionSpec is a tuple subclass
        entries = bounded_tuple(pspec, "from_partition_spec: pspec", MAX_RANK)
    else:
        raise ShardingError(f"from_partition_spec: pspec must be a jax PartitionSpec or a tuple of its entries, "
                            f"got {type(pspec).__name__} {short_repr(pspec)}")
    if len(entries) > MAX_RANK:
        raise ShardingError(f"from_partition_spec: {len(entries)} entries; a spec has at most {MAX_RANK} dims")
    dims = []
    for i, e in enumerate(entries):
        if e is None or isinstance(e, str):
            dims.append(DimSpec.coerce(e))
        elif isinstance(e, (tuple, list)) and all(isinstance(a, str) for a in e):
            dims.append(DimSpec(tuple(e)))
        elif is_unconstrained(e):
            dims.append(DimSpec((), is_open=True))
        else:
            raise ShardingError(f"from_partition_spec: entry {i} of {short_repr(pspec)} is {type(e).__name__} {short_repr(e)}; "
                                f"an entry is None, an axis name (str), a tuple of axis names or "
                                f"PartitionSpec.UNCONSTRAINED")
    try:
        return ShardingSpec(mesh, dims, partial_axes=sorted(unreduced, key=str))
    except ShardingError as e:
        raise ShardingError(f"from_partition_spec: {short_repr(pspec)}: {e}") from None


def _mhlo_args(a: Any, b: Any, who: str) -> tuple[DeviceMesh, Any]:
    """``(mesh, text)`` from either order; the old ``(text, mesh)`` warns."""
    if isinstance(b, DeviceMesh) and not isinstance(a, DeviceMesh):
        warnings.warn(f"{who}(text, mesh, rank) is deprecated; pass the mesh first: {who}(mesh, text, rank)",
                      DeprecationWarning, stacklevel=3)  # the caller of from_mhlo
        a, b = b, a
    if not isinstance(a, DeviceMesh):
        raise ShardingError(f"{who}(mesh, text, rank=None): mesh must be a DeviceMesh, got "
                            f"{type(a).__name__} {short_repr(a)}")
    return a, b


def _from_mhlo_method(mesh: DeviceMesh, text: str, rank: int | None = None) -> ShardingSpec:
    """The spec an HLO sharding string (``"{devices=[2,1]0,1}"``) describes on ``mesh``.

    ``rank`` is needed for ``{replicated}`` and must agree with the tile dims when given. The old
    order ``from_mhlo(text, mesh, rank)`` still works, with a ``DeprecationWarning``.
    """
    mesh, text = _mhlo_args(mesh, text, "from_mhlo")
    return from_mhlo(mesh, text, rank)


# ShardingSpec's format methods, set here where the formats are (spec.py sits below this module)
_from_mhlo_method.__name__, _from_mhlo_method.__qualname__ = "from_mhlo", "ShardingSpec.from_mhlo"
ShardingSpec.to_mhlo = to_mhlo  # type: ignore[attr-defined]
ShardingSpec.from_mhlo = staticmethod(_from_mhlo_method)  # type: ignore[attr-defined]
ShardingSpec.to_partition_spec = to_partition_spec  # type: ignore[attr-defined]
ShardingSpec.from_partition_spec = staticmethod(from_partition_spec)  # type: ignore[attr-defined]