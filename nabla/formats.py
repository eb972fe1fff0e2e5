"""Text and JAX formats of a ShardingSpec: HLO/MHLO sharding strings (seed 003) with XLA's semantics
(tile dims map to tensor dims in order; ``last_tile_dim_replicate`` lists each tile's replicas), and
JAX ``PartitionSpec`` (jax is imported only when one is asked for)."""

from __future__ import annotations

import re
from math import prod
from typing import Any

import numpy as np

from .errors import ShardingError
from .layout import dim_position
from .mesh import AxisRef, DeviceMesh, merge_adjacent
from .spec import DimSpec, ShardingSpec


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


_TOKEN = re.compile(r"\s*(?:(?P<num>\d+)|(?P<word>[A-Za-z_]+)|(?P<sym><=|[{}\[\],=()T]))")


class _Parser:
    """A tiny recursive-descent reader that reports the character position of any fault."""

    def __init__(self, text: str) -> None:
        self.text, self.pos = text, 0

    def fail(self, what: str) -> ShardingError:
        shown = self.text[:self.pos] + " <<here>> " + self.text[self.pos:]
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
            raise self.fail(f"expected {expected or kind}, found {tok!r}")
        self.pos = m.end()
        return tok

    def ints(self, close: str) -> list[int]:
        out = [int(self.take(kind="num"))]
        while self.peek() == ",":
            self.take(",")
            out.append(int(self.take(kind="num")))
        self.take(close)
        return out

    def end(self) -> None:
        if self.text[self.pos:].strip():
            raise self.fail(f"unexpected text {self.text[self.pos:].strip()!r} after the closing brace")


def from_mhlo(text: str, mesh: DeviceMesh, rank: int | None = None) -> ShardingSpec:
    if not isinstance(text, str):
        raise ShardingError(f"from_mhlo: expected a str, got {type(text).__name__}")
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
        dev = int(p.take(kind="num"))
        p.take("}")
        p.end()
        if dev not in mesh.devices:
            raise ShardingError(f"from_mhlo: maximal device={dev} is not in mesh @{mesh.name} "
                                f"(devices {list(mesh.devices)})")
        if rank is None:
            raise ShardingError("from_mhlo: '{maximal ...}' carries no rank; pass rank=")
        # nabla has no one-device placement: every device then holds the whole value, device `dev` included.
        return ShardingSpec.replicated(mesh, rank)
    if head != "devices":
        p.pos -= len(head)
        raise p.fail(f"expected 'replicated', 'maximal' or 'devices', found {head!r}")
    p.take("=")
    p.take("[")
    dims = p.ints("]")
    if p.peek() == "<=":  # XLA's iota form: <=[reshape dims] with an optional T(perm)
        p.take("<=")
        p.take("[")
        iota = p.ints("]")
        ids = np.arange(prod(iota)).reshape(iota)
        if p.peek() == "T":
            p.take("T")
            p.take("(")
            perm = p.ints(")")
            if sorted(perm) != list(range(len(iota))):
                raise p.fail(f"T{tuple(perm)} is not a permutation of {len(iota)} dims")
            ids = ids.transpose(perm)
        ids = ids.reshape(-1).tolist()
    else:
        ids = [int(p.take(kind="num"))]
        while p.peek() == ",":
            p.take(",")
            ids.append(int(p.take(kind="num")))
    replicate = False
    if p.peek() == "last_tile_dim_replicate":
        p.take("last_tile_dim_replicate")
        replicate = True
    p.take("}")
    p.end()
    return _from_tiles(dims, ids, replicate, mesh, rank, text)


def _from_tiles(dims: list[int], ids: list[int], replicate: bool, mesh: DeviceMesh, rank: int | None,
                text: str) -> ShardingSpec:
    if prod(dims) != len(ids):
        raise ShardingError(f"from_mhlo: tile dims {dims} hold {prod(dims)} devices but {len(ids)} are listed in {text!r}")
    if prod(dims) != mesh.size:
        raise ShardingError(f"from_mhlo: tile dims {dims} hold {prod(dims)} devices but mesh @{mesh.name} "
                            f"{list(mesh.shape)} has {mesh.size}")
    if sorted(ids) != sorted(mesh.devices):
        raise ShardingError(f"from_mhlo: devices {ids} are not the devices of mesh @{mesh.name} {list(mesh.devices)}")
    tiles = dims[:-1] if replicate else dims
    if rank is not None and rank != len(tiles):
        raise ShardingError(f"from_mhlo: {text!r} tiles {len(tiles)} dims but rank={rank} was given")
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
    return ShardingError(f"from_mhlo: the device order of {text!r}{where} is not a tiling of mesh {mesh!r} "
                         f"by its axes or sub-axes")


# ---- JAX PartitionSpec ---------------------------------------------------------------------------


def to_partition_spec(spec: ShardingSpec) -> Any:
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
        try:
            return PartitionSpec(*entries, unreduced=set(spec.partial_axes))
        except TypeError:
            raise ShardingError(f"to_partition_spec: partial axes {list(spec.partial_axes)} need a jax whose "
                                f"PartitionSpec has `unreduced`") from None
    return PartitionSpec(*entries)


def from_partition_spec(mesh: DeviceMesh, pspec: Any) -> ShardingSpec:
    dims = []
    for e in tuple(pspec):
        if e is not None and not isinstance(e, (str, tuple, list)):  # PartitionSpec.UNCONSTRAINED
            dims.append(DimSpec((), is_open=True))
        else:
            dims.append(DimSpec.coerce(e))
    partial = tuple(sorted(getattr(pspec, "unreduced", ()) or ()))
    return ShardingSpec(mesh, dims, partial_axes=partial)
