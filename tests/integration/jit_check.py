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
    def fits(e, c) -> bool:
        kind, nbytes, got = c
        if (kind, nbytes) != (e.kind, e.bytes):
            return False
        groups = axis_groups(mesh, e.axes)
        if kind != "collective_permute":
            return got == groups
        where = {p: g for g in groups for p in g}
        return all(where[u] == where[v] for u, v in got)

    # a perfect matching of log events to HLO collectives (augmenting paths: a permute over more axes fits more
    # of the HLO's permutes, so a greedy pass could take one a narrower permute needs)
    owner: dict[int, int] = {}

    def place(i: int, seen: set) -> bool:
        for j, c in enumerate(hlo):
            if j in seen or not fits(events[i], c):
                continue
            seen.add(j)
            if j not in owner or place(owner[j], seen):
                owner[j] = i
                return True
        return False

    for i, e in enumerate(events):
        if not place(i, set()):
            groups = axis_groups(mesh, e.axes)
            left = [c for j, c in enumerate(hlo) if j not in owner]
            raise AssertionError(f"no collective of the HLO matches {e!r} over {e.axes} (groups "
                                 f"{sorted(map(sorted, groups))}); unmatched: {left}")


def assert_jit_matches_eager(fn, *args, rtol=1e-5, atol=1e-6, same_log=True):
    """``nb.jit(fn)`` gives eager nabla's values on every device, its lowered comm log is eager's (unless
    ``same_log`` is False: ``fn`` computes what it drops, which nb.jit does not run), and the compiled HLO moves
    exactly what that log says; returns the lowered program."""
    import numpy as np

    import nabla as nb
    with nb.comm_log() as eager:
        want = fn(*args)
    jitted = nb.jit(fn)
    lowered = jitted.lower(*args)
    got = jitted(*args)
    assert got.shape == want.shape and got.dtype == want.dtype, (got, want)
    np.testing.assert_allclose(got.numpy().astype(np.float64), want.numpy().astype(np.float64), rtol=rtol, atol=atol)
    if want.sharding is not None and not want.sharding.partial_axes:
        for d in want.sharding.mesh.devices:
            np.testing.assert_allclose(np.asarray(got.shards[d]).astype(np.float64),
                                       np.asarray(want.shards[d]).astype(np.float64), rtol=rtol, atol=atol)
    assert not same_log or sorted((e.kind, e.axes, e.bytes) for e in lowered.comm_log.events) == \
        sorted((e.kind, e.axes, e.bytes) for e in eager.events)
    assert_hlo_is_the_log(lowered)
    return lowered
