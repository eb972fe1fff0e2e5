"""The time of one recorded collective on a cluster: alpha-beta per ring step on the link tier its groups use,
in phases when a group spans NVLink and the network. The bytes are the comm log's; this module only prices them."""

from __future__ import annotations

import math
from typing import NamedTuple

from ..collectives import REGISTRY, CommEvent
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
    group of ``k = k_in * k_out``; from it the local block ``B`` is recovered and, for a hierarchical tier:

    - all_reduce = reduce_scatter inside (``k_in``, ``(k_in-1)/k_in * B`` on NVLink)
      + all_reduce across (``k_out``, ``2(k_out-1)/k_out * B/k_in`` on the network)
      + all_gather inside (``k_in``, ``(k_in-1)/k_in * B`` on NVLink);
    - reduce_scatter = reduce_scatter inside on ``B`` + reduce_scatter across on ``B/k_in``;
    - all_gather (``B`` the local shard) = all_gather across (``(k_out-1) * B`` on the network)
      + all_gather inside on ``k_out * B`` (``(k_in-1) * k_out * B`` on NVLink);
    - all_to_all: the ``(k_in-1)/k`` of ``B`` bound for the node stays on NVLink, the ``(k-k_in)/k`` for other
      nodes goes on the network; the two legs run at once (see ``event_time``);
    - collective_permute: some device's block crosses a node whenever a group spans nodes, so the whole
      ``B`` is priced on the network.
    """
    k, kind, sent = tier.group, event.kind, float(event.bytes)
    if kind not in REGISTRY or REGISTRY[kind].local:
        raise ShardingError(f"comm: unknown collective kind {kind!r}; kinds are "
                            f"{[n for n, c in REGISTRY.items() if not c.local]}")
    if sent == 0:
        return ()
    if kind == "collective_permute":
        return (Phase(kind, "nvlink" if tier.kind == "nvlink" else "network", k, sent),)
    if k == 1:
        return ()
    if tier.kind != "hierarchical":
        return (Phase(kind, tier.kind, k, sent),)
    k_in, k_out = tier.k_in, tier.k_out
    if kind == "all_to_all":
        return (Phase(kind, "nvlink", k_in, sent * (k_in - 1) / (k - 1)),
                Phase(kind, "network", k_out, sent * (k - k_in) / (k - 1)))
    if kind == "all_reduce":
        b = sent * k / (2 * (k - 1))
        return (Phase("reduce_scatter", "nvlink", k_in, (k_in - 1) / k_in * b),
                Phase("all_reduce", "network", k_out, 2 * (k_out - 1) / k_out * b / k_in),
                Phase("all_gather", "nvlink", k_in, (k_in - 1) / k_in * b))
    if kind == "reduce_scatter":
        b = sent * k / (k - 1)
        return (Phase(kind, "nvlink", k_in, (k_in - 1) / k_in * b),
                Phase(kind, "network", k_out, (k_out - 1) / k_out * b / k_in))
    if kind == "all_gather":
        b = sent / (k - 1)
        return (Phase(kind, "network", k_out, (k_out - 1) * b),
                Phase(kind, "nvlink", k_in, (k_in - 1) * k_out * b))
    raise ShardingError(f"comm: no hierarchical pricing for collective kind {kind!r}")


def phase_time(phase: Phase, cluster: Cluster) -> float:
    """Ring steps times the tier's latency plus bytes over its achievable bandwidth; an all_reduce across
    nodes takes NCCL's double binary tree instead when that is faster (as NCCL's tuner picks): ``2 log2(k)``
    hops of the tree latency, at the tree's fraction of the bandwidth."""
    hw = cluster.hardware
    latency, bandwidth = hw.link(phase.tier)
    steps = REGISTRY[phase.kind].ring_steps(phase.group) if phase.group > 1 else 0
    if phase.kind == "collective_permute":
        steps = 1
    ring = steps * latency + phase.bytes / bandwidth
    if phase.kind != "all_reduce" or phase.tier != "network" or phase.group <= 2:
        return ring
    tree = 2 * math.ceil(math.log2(phase.group)) * hw.tree_latency + phase.bytes / (bandwidth * hw.tree_efficiency)
    return min(ring, tree)


def event_time(event: CommEvent, cluster: Cluster, mesh: DeviceMesh) -> float:
    """Seconds for ``event`` on ``cluster``: its legs one after another (all_to_all's two legs at once)."""
    legs = phases(event, cluster.tier(mesh, event.axes))
    times = [phase_time(p, cluster) for p in legs]
    if event.kind == "all_to_all":
        return max(times, default=0.0)
    return sum(times)
