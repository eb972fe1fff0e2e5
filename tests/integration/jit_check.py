"""Checks for nb.jit's compiled programs: the collectives of the compiled HLO (read with the XLA harness) are
exactly those of the lowered comm log: kinds, bytes, and the devices each spans."""

from __future__ import annotations

import xla_harness as H


def hlo_collectives(hlo: str, with_groups: bool = False) -> list[tuple]:
    """(kind, bytes per device) of every collective in compiled HLO (``with_groups``: and its device groups, a
    frozenset of frozensets of partitions, or for a collective-permute its non-self (source, target) pairs); a
    combined all-reduce (XLA merges several into one instruction of tuple operands) counts per operand, as
    nabla logs them."""
    insts = H.parse_instructions(hlo)
    types = {i.name: i.type for i in insts}
    out = []
    for c in H.collectives(hlo):
        inst = next(i for i in insts if i.line == c.hlo)
        operands = [o for o in inst.operands if o in types]
        if c.kind == "collective_permute":
            groups = frozenset((a, b) for a, b in c.groups if a != b)
        else:
            groups = frozenset(frozenset(g) for g in c.groups)
        if c.kind == "all_reduce" and len(operands) > 1:
            k = c.group
            out += [("all_reduce", 2 * (k - 1) * H.shape_bytes(types[o]) // k, groups) for o in operands]
        else:
            out.append((c.kind, c.bytes, groups))
    return sorted(out, key=repr) if with_groups else sorted(x[:2] for x in out)


def axis_groups(mesh, axes) -> frozenset:
    """The partitions (mesh positions, which are jax's partition ids under nb.jit) that differ only along
    ``axes`` (mesh axes or sub-axes): one collective group each."""
    refs = [mesh.axis_ref(a) for a in axes]
    groups: dict = {}
    for p, d in enumerate(mesh.devices):
        coords = list(mesh.coords(d))
        for r in refs:
            i = mesh.axis_index(r.name)
            coords[i] -= r.coord(coords[i]) * r.minor
        groups.setdefault(tuple(coords), set()).add(p)
    return frozenset(frozenset(g) for g in groups.values())


def assert_hlo_is_the_log(lowered):
    """The compiled HLO holds exactly the lowered comm log's collectives: kinds, bytes, and the devices each
    one spans (the replica groups of the event's mesh axes; a permute's pairs within them)."""
    mesh = lowered._program.mesh
    hlo = hlo_collectives(lowered.as_text(), with_groups=True)
    events = lowered.comm_log.events
    assert sorted((k, b) for k, b, _ in hlo) == sorted((e.kind, e.bytes) for e in events), (hlo, events)
    left = list(hlo)
    for e in sorted(events, key=lambda e: e.kind != "collective_permute"):  # permutes: most constrained last
        groups = axis_groups(mesh, e.axes)
        where = {p: g for g in groups for p in g}
        for j, (kind, nbytes, got) in enumerate(left):
            if (kind, nbytes) != (e.kind, e.bytes):
                continue
            if kind == "collective_permute" and all(where[u] == where[v] for u, v in got) or got == groups:
                del left[j]
                break
        else:
            raise AssertionError(f"no collective of the HLO matches {e!r} over {e.axes} (groups "
                                 f"{sorted(map(sorted, groups))}); unmatched: {left}")
