"""The time of one recorded collective on a cluster: alpha-beta per ring step on the link tier its groups use,
in phases when a group spans NVLink and the network. The bytes are the comm log's; this module only prices them."""

from __future__ import annotations

import math
from typing import NamedTuple

from ..collectives import REGISTRY, CommEvent, kinds
from ..errors import ShardingError
from ..mesh import DeviceMesh
from .cluster import Cluster, Tier


class Phase(NamedTuple):
    """One leg of a collective: ``kind`` run over ``group`` devices on ``tier``, each sending ``bytes``."""

    kind: str
    tier: str
    group: int
    bytes: float


def phases(event: CommEvent, tier: Tier) -> tuple[Phase, ...]:
    """The legs of ``event`` on ``tier``. ``event.bytes`` is what each device sends in a flat ring over the
    group of ``k = k_in * k_out``; on a tier spanning NVLink and the network, the kind's registry entry says how
    it runs in legs (``Collective.legs``: all_reduce = reduce_scatter inside + all_reduce across on the node's
    share + all_gather inside; reduce_scatter inside then across; all_gather across then inside; all_to_all's
    node-bound and network-bound parts at once). A kind without legs is priced whole on the network; so is a
    pairwise kind (``Collective.pairwise``, a permute: some device's block crosses a node whenever a group spans
    nodes), which on one NVLink or network tier, even over a group of one, is priced there."""
    k, kind, sent = tier.group, event.kind, float(event.bytes)
    entry = REGISTRY.get(kind)
    if entry is None or entry.local or entry.logs_as:
        raise ShardingError(f"comm: unknown collective kind {kind!r}; kinds are {list(kinds())}")
    if sent == 0:
        return ()
    if entry.pairwise:
        return (Phase(kind, "nvlink" if tier.kind == "nvlink" else "network", k, sent),)
    if k == 1:
        return ()
    if tier.kind != "hierarchical":
        return (Phase(kind, tier.kind, k, sent),)
    if entry.legs is None:
        return (Phase(kind, "network", k, sent),)
    return tuple(Phase(*leg) for leg in entry.legs(sent, k, tier.k_in, tier.k_out))


def phase_time(phase: Phase, cluster: Cluster) -> float:
    """Ring steps times the tier's latency plus bytes over its achievable bandwidth; an all_reduce across
    nodes takes NCCL's double binary tree instead when that is faster (as NCCL's tuner picks): ``2 log2(k)``
    hops of the tree latency, at the tree's fraction of the bandwidth."""
    hw = cluster.hardware
    latency, bandwidth = hw.link(phase.tier)
    entry = REGISTRY[phase.kind]
    steps = entry.ring_steps(phase.group) if phase.group > 1 or entry.pairwise else 0
    ring = steps * latency + phase.bytes / bandwidth
    if phase.kind != "all_reduce" or phase.tier != "network" or phase.group <= 2:
        return ring
    tree = 2 * math.ceil(math.log2(phase.group)) * hw.tree_latency + phase.bytes / (bandwidth * hw.tree_efficiency)
    return min(ring, tree)


def event_time(event: CommEvent, cluster: Cluster, mesh: DeviceMesh) -> float:
    """Seconds for ``event`` on ``cluster``: its legs one after another (all_to_all's two legs at once)."""
    legs = phases(event, cluster.tier(mesh, event.axes))
    times = [phase_time(p, cluster) for p in legs]
    return max(times, default=0.0) if REGISTRY[event.kind].legs_at_once else sum(times)
